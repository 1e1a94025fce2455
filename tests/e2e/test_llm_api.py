"""The offline ``LLM`` API as a vLLM user drives it: bad input leaves nothing queued, the
prompt forms it takes, stop tokens' text, and ``chat``'s options (embedded model)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(max_model_len=512)


def test_bad_input_leaves_nothing_queued(llm: LLM) -> None:
    want = llm.generate(["a b", "c d"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="priority must be an int, got 'hi'"):
        llm.generate(["a b", "c d"], GREEDY, priority=[0, "hi"], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(["a b", "c d"], [GREEDY, {"max_tokens": 5}], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="0 entries for 2 prompts"):
        llm.generate(["a b", "c d"], [], use_tqdm=False)
    assert llm.engine.num_request_states == 0
    # the engine serves on, the same texts as before
    again = llm.generate(["a b", "c d"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in want]


def test_token_ids_of_any_integer_type(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("The capital of France is")
    want = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.array(ids), [np.int64(t) for t in ids], np.array([ids, ids])):
        outs = llm.generate(prompt, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
        assert all(o.outputs[0].token_ids == want for o in outs)
    with pytest.raises(ValueError, match="token ids must be integers, got 1.5"):
        llm.generate([[1, 1.5]], GREEDY, use_tqdm=False)  # type: ignore[list-item]


def test_a_stop_tokens_text_is_left_out_unless_asked(llm: LLM) -> None:
    prompt = "The capital of France is"
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[1]  # the second token generated ends the next runs
    stop_text = llm.get_tokenizer().decode([stop_id])
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=6,
            stop_token_ids=[stop_id],
            include_stop_str_in_output=include,
        )
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[:2] and out.stop_reason == stop_id
        first = llm.get_tokenizer().decode(free.token_ids[:1])
        assert out.text == (first + stop_text if include else first)
    # EOS: not in the text even when special tokens are kept
    eos = llm.chat(
        [{"role": "user", "content": "Say OK."}],
        SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False),
        use_tqdm=False,
    )[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in eos.text


def test_chat_options(llm: LLM) -> None:
    prefill = [
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    out = llm.chat(prefill, GREEDY, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt is not None and out.prompt.endswith("assistant\nThe capital of France is")
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(prefill, GREEDY, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="must be the assistant's"):
        llm.chat(prefill[:1], GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail }}"
    out = llm.chat(
        [{"role": "user", "content": "Count: 1, 2,"}],
        GREEDY,
        chat_template=template,
        chat_template_kwargs={"tail": " 3,"},
        use_tqdm=False,
    )[0]
    assert out.prompt == "Count: 1, 2, 3,"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be bool, got 'no'"),
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"seed": "x"}, "seed must be int or None"),
        ({"num_threads": 2.0}, "num_threads must be int or None"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
    ],
)
def test_engine_options_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_seed_none_is_a_random_seed() -> None:
    seeds = {EngineConfig(seed=None).seed for _ in range(3)}
    assert all(isinstance(s, int) for s in seeds) and len(seeds) == 3
    assert EngineConfig().seed == 0


def test_swap_space_too_small_for_one_block(make_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="swap_space=4 bytes holds no KV block"):
        make_llm(max_model_len=256, num_kv_blocks=16, preemption_mode="swap", swap_space=4)
