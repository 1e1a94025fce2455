"""Speculative decoding end to end (issue 52): outputs are plain decoding's.

- The embedded model, n-gram drafts: greedy output equals plain decoding token for token,
  on copy-heavy prompts (drafts accepted) and fresh ones, with prefix caching and with a
  pool small enough to preempt; seeded sampled output equals plain decoding's too (each
  output position draws the same seeded number, ``runtime/spec_verify.py``).
- A tiny random model with a 32-token vocabulary, temperature 1: the distribution of the
  sampled tokens after drafts matches plain sampling (chi-square, unseeded draws).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest

from kvserve.sampling_params import SamplingParams
from tests.e2e.prompts import QUESTIONS, SYSTEM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}

COPY_PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, "
    "cherries.\nList:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# The same "
    "two functions again:\n",
]


@pytest.fixture(scope="module")
def engines(make_llm: Callable[..., object]) -> tuple[object, object]:
    """A plain and a speculating LLM over the same small pool (preemption happens)."""
    kw = dict(num_kv_blocks=12, block_size=16, max_num_seqs=8, max_model_len=512)
    return make_llm(**kw), make_llm(speculative_config=NGRAM, **kw)


def _texts(llm: object, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_output_is_plain_decoding(engines: tuple[object, object]) -> None:
    plain, spec = engines
    fresh = [f"{SYSTEM}\n{q}\n" for q in QUESTIONS[:2]]
    prompts = COPY_PROMPTS + fresh[:1] + COPY_PROMPTS[:1]  # the last: a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = spec.engine.stats()  # type: ignore[attr-defined]
    assert _texts(spec, prompts, params) == _texts(plain, prompts, params)
    after = spec.engine.stats()  # type: ignore[attr-defined]
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert after["preemptions"] > 0 and after["prefix_cache_hits"] > 0
    spec.engine.kv_cache_manager.check_integrity()  # type: ignore[attr-defined]
    assert spec.engine.kv_cache_manager.num_free_blocks == 12  # type: ignore[attr-defined]


def test_seeded_sampling_is_plain_decoding(engines: tuple[object, object]) -> None:
    plain, spec = engines
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=24) for s in range(2)]
    prompts = COPY_PROMPTS
    outs = [
        [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]  # type: ignore[attr-defined]
        for llm in (plain, spec)
    ]
    assert outs[0] == outs[1]


def _chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """p-value of the chi-square test that two samples come from one distribution
    (Wilson-Hilferty approximation of the chi-square tail; categories under 5 expected
    counts are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    stat, df, pooled = 0.0, -1, [0, 0]
    for key in set(a) | set(b):
        row = (a[key], b[key])
        if (row[0] + row[1]) * min(na, nb) / (na + nb) < 5:
            pooled = [pooled[0] + row[0], pooled[1] + row[1]]
            continue
        stat += _cell(row, na, nb)
        df += 1
    if sum(pooled):
        stat += _cell((pooled[0], pooled[1]), na, nb)
        df += 1
    k = max(df, 1)
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _cell(row: tuple[int, int], na: int, nb: int) -> float:
    total = row[0] + row[1]
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    return (row[0] - ea) ** 2 / ea + (row[1] - eb) ** 2 / eb


def test_rejection_sampling_keeps_the_distribution(tmp_path: object) -> None:
    from kvserve.engine.llm import LLM
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(
        str(tmp_path), vocab_size=32, initializer_range=0.6, bos_token_id=1, eos_token_id=2
    )
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    spec_cfg = {**NGRAM, "adaptive": False, "disable_by_batch_size": 1000}
    kw = dict(dtype="float32", quantization="none", max_model_len=64, max_num_seqs=64, seed=1)
    plain = [
        tuple(o.outputs[0].token_ids)
        for o in LLM(model=path, **kw).generate([prompt] * 1000, params, use_tqdm=False)
    ]
    # NOTE: n-gram drafts on a random model are almost never right; these drafts are the
    # commonest tokens of each output position, so many are accepted and many rejected.
    common = [Counter(s[pos] for s in plain).most_common(1)[0][0] for pos in range(4)]
    llm = LLM(model=path, speculative_config=spec_cfg, **kw)
    llm.engine.scheduler.spec.propose = (
        lambda request, k: common[  # type: ignore[attr-defined]
            request.num_output_tokens : request.num_output_tokens + k
        ]
    )
    outs = llm.generate([prompt] * 1000, params, use_tqdm=False)
    spec_out = [tuple(o.outputs[0].token_ids) for o in outs]
    stats = llm.engine.stats()
    assert stats["spec_decode_num_drafts"] >= 1000
    assert 0.1 < stats["spec_decode_acceptance_rate"] < 0.9
    assert plain != spec_out  # unseeded: different draws, the same distribution
    for pos in range(4):
        p = _chi_square_p(Counter(s[pos] for s in plain), Counter(s[pos] for s in spec_out))
        assert p > 1e-3, f"output position {pos}: chi-square p = {p:.2g}"
    # Pairs of tokens one verification decides together.
    p = _chi_square_p(Counter(s[1:3] for s in plain), Counter(s[1:3] for s in spec_out))
    assert p > 1e-3, f"token pairs: chi-square p = {p:.2g}"


def test_speculation_refuses_async_scheduling() -> None:
    from kvserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineConfig(speculative_config={"method": "draft_model"})
    config = EngineConfig(
        speculative_config=str(EngineConfig(speculative_config=NGRAM).speculative_config)
    )
    assert config.speculative_config is not None
    assert config.speculative_config.num_speculative_tokens == 4
