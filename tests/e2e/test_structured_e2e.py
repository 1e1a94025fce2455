"""Structured output, logit_bias and prompt logprobs through the offline API on the embedded
model: constrained greedy outputs do not depend on memory management (prefix cache on/off,
recompute and swap preemption), every output validates, n > 1 samples each follow the
grammar, and prompt logprobs equal a full forward's log-softmax."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvserve.bench.structured_schemas import PROMPTS, SCHEMAS
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams as S

MAX_TOKENS = 64


def _prompts(llm) -> tuple[list[list[int]], list[SamplingParams], list[str]]:
    names = list(SCHEMAS) * 2
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[n]}]) for n in names
    ]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=S(json=SCHEMAS[n])
        )
        for n in names
    ]
    return prompts, params, names


def _run(llm) -> list[list[int]]:
    prompts, params, names = _prompts(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, name in zip(outs, names, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(make_llm) -> list[list[int]]:
    llm = make_llm(num_kv_blocks=512)
    tokens = _run(llm)
    assert llm.engine.structured.stats.num_rejected_tokens == 0
    return tokens


def test_constrained_identical_without_prefix_cache(make_llm, reference) -> None:
    llm = make_llm(num_kv_blocks=512, enable_prefix_caching=False)
    assert _run(llm) == reference


def test_constrained_identical_on_prefix_hits(make_llm, reference) -> None:
    llm = make_llm(num_kv_blocks=512)
    assert _run(llm) == reference
    assert _run(llm) == reference
    assert llm.stats()["prefix_hit_rate"] > 0.3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_identical_under_preemption(make_llm, reference, mode: str) -> None:
    llm = make_llm(num_kv_blocks=14, preemption_mode=mode, max_num_batched_tokens=128)
    assert _run(llm) == reference
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["kv_usage"] == 0
    structured = llm.engine.structured
    if mode == "recompute":
        assert structured.stats.num_rebuilt > 0
    assert structured.num_matchers == 0 and structured.stats.num_rejected_tokens == 0
    llm.engine.kv_cache_manager.check_integrity()


def test_parallel_samples_each_follow_the_grammar(make_llm) -> None:
    llm = make_llm(num_kv_blocks=512)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS["person"]}])
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        structured_outputs=S(json=SCHEMAS["person"]),
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    assert len(set(texts)) > 1  # sampled, not copies
    assert llm.engine.structured.stats.num_forked >= 3


def test_regex_choice_and_grammar_are_exact(make_llm) -> None:
    llm = make_llm(num_kv_blocks=256)
    cases = [
        (S(regex=r"[0-9]{3}-[0-9]{4}"), r"^[0-9]{3}-[0-9]{4}$"),
        (S(choice=["alpha", "beta", "gamma"]), r"^(alpha|beta|gamma)$"),
        (S(grammar='root ::= "(" [a-c]+ ")"'), r"^\([a-c]+\)$"),
    ]

    for spec, pattern in cases:
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                temperature=temperature, seed=3, max_tokens=24, structured_outputs=spec, n=2
            )
            out = llm.generate(["Say something:"], params, use_tqdm=False)[0]
            for c in out.outputs:
                if c.finish_reason == "stop":
                    assert re.match(pattern, c.text), (spec, c.text)


def test_unsatisfiable_in_max_tokens_ends_with_length(make_llm) -> None:
    llm = make_llm(num_kv_blocks=256)
    schema = {
        "type": "object",
        "properties": {"essay": {"type": "string", "minLength": 400}},
        "required": ["essay"],
    }
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=S(json=schema))
    out = llm.generate(["Write:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    # NOTE: whitespace may separate JSON's tokens (vLLM's default; --disable-any-whitespace).
    assert re.match(r'\{\s*"essay"\s*:\s*"', out.text), out.text


def test_invalid_constraint_or_bias_queues_nothing(make_llm) -> None:
    llm = make_llm(num_kv_blocks=64)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.engine.add_request("x", SamplingParams(structured_outputs=S(regex="(")))
    with pytest.raises(ValueError, match="logit_bias token id 99999"):
        llm.engine.add_request("x", SamplingParams(logit_bias={99999: 1.0}))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.structured.num_matchers == 0


def test_logit_bias_forces_a_token(make_llm) -> None:
    llm = make_llm(num_kv_blocks=64)
    target = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={target: 100.0})
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [target] * 3


def test_prompt_logprobs_equal_full_forward(make_llm, hf_model) -> None:
    # NOTE: a 16-token budget splits the prompt into chunks; the second run of the same prompt
    # would hit the prefix cache, which prompt_logprobs bypasses (same values, no cached tokens).
    llm = make_llm(num_kv_blocks=256, max_num_batched_tokens=16)
    text = "The history of the printing press begins in the fifteenth century, when Johannes"
    ids = llm.tokenizer.encode(text * 2, add_special_tokens=False)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for run in range(2):
        out = llm.generate([ids], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(ids) and lps[0] is None
        for pos in range(1, len(ids)):
            entry = lps[pos]
            assert entry is not None
            want = ref[pos - 1]
            assert abs(entry[ids[pos]].logprob - float(want[ids[pos]])) < 2e-3
            top = torch.topk(want, 3).indices.tolist()
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
            assert [t for _, t in ranked][:2] == top[:2]
        assert out.num_cached_tokens == 0, run


def test_abort_frees_matchers(make_llm) -> None:
    llm = make_llm(num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, n=3, structured_outputs=S(json=SCHEMAS["todo"]))
    rid = engine.add_request("List:", params)
    assert engine.structured.num_matchers == 3
    engine.step()
    engine.step()
    engine.abort_request(rid)
    assert engine.structured.num_matchers == 0 and not engine.structured.has(rid)
    assert not engine.has_unfinished_requests()
