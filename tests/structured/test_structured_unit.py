"""StructuredOutputsParams, the grammar compiler's cache, the manager's matcher life cycle
(fork, recompute rebuild, free) and the sampler's bitmask, on the embedded model's tokenizer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvserve.core.outputs import GrammarBitmask, ScheduledRequest, SchedulerOutput
from kvserve.models.loader import default_model_path
from kvserve.request import Request, RequestStatus
from kvserve.runtime.logits_constraints import match_bitmask_rows
from kvserve.runtime.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams as S
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.manager import StructuredOutputManager
from kvserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = default_model_path()
    return Tokenizer.from_loaded(os.path.dirname(path), os.path.basename(path))


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id)


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{nope")
    assert S(json=SCHEMA).key() == S(json=json.dumps(SCHEMA)).key()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (S(regex="a(b"), "unclosed group"),
        (S(grammar="start: foo"), "unknown name"),
        (S(json={"type": "foo"}), "foo"),
        (S(json={"$ref": "#/nope"}), "nope"),
    ],
)
def test_invalid_constraints_name_the_problem(
    manager: StructuredOutputManager, spec: S, needle: str
) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind}") as info:
        manager.validate(spec)
    assert needle in str(info.value)


def test_boolean_schemas_compile(manager: StructuredOutputManager) -> None:
    # ``true`` (any JSON value) was a 400 ("Expecting object schema to apply options") and
    # ``false`` was taken for an unset field ("got none").
    for schema in (True, "true", {}):
        manager.validate(S(json=schema))
    assert S(json=True).key() == S(json={}).key()
    for schema in (False, "false"):
        with pytest.raises(ValueError, match="schema false"):
            S(json=schema)


def test_compile_once_then_cache_hits_and_bound(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id, 2)
    a, b, c = S(regex="[0-9]+"), S(choice=["x", "y"]), S(json=SCHEMA)
    compiler.compile(a)
    compiler.compile(a)
    assert (compiler.stats.num_compiled, compiler.stats.num_cache_hits) == (1, 1)
    compiler.compile(b)
    compiler.compile(c)  # evicts a (least recently used)
    assert len(compiler) == 2
    compiler.compile(a)
    assert compiler.stats.num_compiled == 4


def _allowed(bitmask: np.ndarray, row: int, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask[row : row + 1].view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits[:vocab])}


def _sched(reqs: list[Request], preempted: set[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled=[
            ScheduledRequest(
                request_id=r.request_id,
                token_ids=[0],
                start_pos=r.num_tokens - 1,
                block_ids=[],
                sample=True,
                sampling_params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
            )
            for r in reqs
        ],
        preempted_req_ids=preempted or set(),
    )


def test_matcher_follows_tokens_forks_rebuilds_and_frees(
    manager: StructuredOutputManager, tokenizer: Tokenizer
) -> None:
    spec = S(choice=["yes", "no"])
    params = SamplingParams(structured_outputs=spec)
    reqs = [Request(f"r#{i}", [1, 2], params) for i in range(2)]
    manager.add_request([r.request_id for r in reqs], spec)
    forked = manager.stats.num_forked
    assert forked >= 1
    sched = _sched(reqs)
    manager.prepare(sched, {r.request_id: r for r in reqs}.get)
    assert sched.grammar_bitmask is not None
    first = _allowed(sched.grammar_bitmask.bitmask, 0, 49152)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert yes[0] in first and tokenizer.eos_token_id not in first
    # Sample 0 takes "yes": its grammar is complete (the engine then finishes it); were it
    # sampled again, only EOS would be allowed. Sample 1 is untouched.
    reqs[0].output_token_ids.extend(yes)
    assert manager.update(reqs) == (["r#0"], {})
    sched = _sched(reqs)
    manager.prepare(sched, {r.request_id: r for r in reqs}.get)
    assert sched.grammar_bitmask is not None
    assert _allowed(sched.grammar_bitmask.bitmask, 0, 49152) == {tokenizer.eos_token_id}
    assert _allowed(sched.grammar_bitmask.bitmask, 1, 49152) == first
    # Recompute preemption drops the matcher; the next prepare rebuilds it from the tokens.
    rebuilt = manager.stats.num_rebuilt
    reqs[0].status = RequestStatus.PREEMPTED
    manager.prepare(_sched([], {"r#0"}), {r.request_id: r for r in reqs}.get)
    num_before = manager.num_matchers
    sched = _sched(reqs)
    manager.prepare(sched, {r.request_id: r for r in reqs}.get)
    assert manager.stats.num_rebuilt == rebuilt + 1 and manager.num_matchers == num_before + 1
    assert sched.grammar_bitmask is not None
    assert _allowed(sched.grammar_bitmask.bitmask, 0, 49152) == {tokenizer.eos_token_id}
    # Swap keeps it: a SWAPPED request's matcher stays.
    reqs[1].status = RequestStatus.SWAPPED
    manager.prepare(_sched([], {"r#1"}), {r.request_id: r for r in reqs}.get)
    assert manager.has("r#1") and manager.num_matchers == num_before + 1
    for r in reqs:
        manager.free(r.request_id)
    assert not manager.has("r#0") and manager.num_matchers == num_before - 1
    assert manager.stats.num_rejected_tokens == 0


class _NothingAllowed:
    """A matcher stand-in whose mask allows no token at all (nor EOS), not stopped."""

    def is_error(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return False

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        return None  # leaves the row all zero


class _Broken:
    """A matcher stand-in that raises from every method (a grammar-engine bug)."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"matcher.{name} is broken")


@pytest.mark.parametrize("has_eos", [True, False])
def test_grammar_faults_are_reported_per_request_and_get_no_row(
    tokenizer: Tokenizer, has_eos: bool
) -> None:
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager(tokenizer.hf_tokenizer, 49152, eos if has_eos else None)
    spec = S(choice=["yes", "no"])
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(structured_outputs=spec)) for i in range(4)]
    manager.add_request([r.request_id for r in reqs], spec)
    manager._states["r1"].matcher = _NothingAllowed()
    manager._states["r2"].matcher = _Broken()
    sched = _sched(reqs)
    faults = manager.prepare(sched, {r.request_id: r for r in reqs}.get)
    grammar = sched.grammar_bitmask
    assert grammar is not None
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert "computing the mask" in faults["r2"] and "is broken" in faults["r2"]
    if has_eos:  # every token masked: EOS only, the request ends on it
        assert list(faults) == ["r2"] and grammar.request_ids == ["r0", "r1", "r3"]
        assert _allowed(grammar.bitmask, 1, 49152) == {eos}
    else:  # no EOS to end it with: it fails instead of sampling from an empty row
        assert set(faults) == {"r1", "r2"}
        assert "allows no next token" in faults["r1"]
        assert grammar.request_ids == ["r0", "r3"]
    assert grammar.bitmask.shape == (len(grammar.request_ids), 49152 // 32)
    assert yes[0] in _allowed(grammar.bitmask, 0, 49152)
    assert yes[0] in _allowed(grammar.bitmask, len(grammar.request_ids) - 1, 49152)
    assert manager.num_matchers == 4 - len(faults) and manager.stats.num_faults == len(faults)
    # update: a matcher that raises on consuming is reported, the others advance.
    manager._states["r3"].matcher = _Broken()
    for r in (reqs[0], reqs[3]):
        r.output_token_ids.extend(yes)
    ended, update_faults = manager.update([reqs[0], reqs[3]])
    assert ended == ["r0"] and list(update_faults) == ["r3"]
    assert "consuming the sampled token" in update_faults["r3"]
    assert manager.stats.num_faults == len(faults) + 1 and "r3" not in manager._states


def test_sampler_applies_bitmask_before_sampling_and_keeps_raw_logprobs() -> None:
    vocab = 100
    sampler = Sampler(vocab, seed=0)
    allowed = [7, 42, 99]
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    for t in allowed:
        bitmask.view(np.uint32)[0, t // 32] |= np.uint32(1 << (t % 32))
    logits = torch.randn(2, vocab)
    logits[:, 3] = 50.0  # the unconstrained favourite
    before = logits.clone()
    reqs = [
        ScheduledRequest(
            f"r{i}", [0], 0, [], True, SamplingParams(temperature=t, logprobs=1), [0], []
        )
        for i, t in enumerate((0.0, 1.0))
    ]
    grammar = GrammarBitmask(["r1"], bitmask)
    for _ in range(20):
        ids, lps = sampler.sample(logits, reqs, match_bitmask_rows(grammar, reqs))
        assert ids[0] == 3 and ids[1] in allowed
        assert lps[1] is not None and lps[1][ids[1]].logprob < -10  # raw, not renormalised
    assert torch.equal(logits, before)


def test_logit_bias_moves_the_argmax() -> None:
    sampler = Sampler(10, seed=0)
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0
    req = ScheduledRequest(
        "r", [0], 0, [], True, SamplingParams(temperature=0, logit_bias={6: 10.0}), [0], []
    )
    assert sampler.sample(logits, [req])[0] == [6]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


@pytest.mark.parametrize("compact", [False, True])
def test_json_allows_whitespace_between_tokens_unless_compact(
    tokenizer: Tokenizer, compact: bool
) -> None:
    # vLLM's default backend allows any whitespace; disable_any_whitespace forbids it.
    compiler = GrammarCompiler(
        tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id, compact_json=compact
    )
    matcher = compiler.compile(S(json=SCHEMA))
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    assert matcher.consume_token(brace)
    row = np.zeros((1, 49152 // 32), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    allowed = _allowed(row, 0, 49152)
    spaces = {*tokenizer.encode(" ", add_special_tokens=False)}
    spaces |= {*tokenizer.encode("\n", add_special_tokens=False)}
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert quote in allowed
    assert bool(spaces & allowed) is not compact
