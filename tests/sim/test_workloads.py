"""Deterministic workload generators and the JSONL trace format."""

import math

import numpy as np
import pytest

from kvserve.sim.workloads import (
    WorkloadRequest,
    generate_workload,
    load_jsonl,
    resolve_prompt_token_ids,
    save_jsonl,
)


@pytest.mark.parametrize("kind", ["random", "sharegpt", "shared-prefix", "multi-turn"])
def test_deterministic_and_roundtrips(kind: str, tmp_path) -> None:
    a = generate_workload(kind, 40, seed=3, request_rate=5.0)
    assert a == generate_workload(kind, 40, seed=3, request_rate=5.0)
    assert a != generate_workload(kind, 40, seed=4, request_rate=5.0)
    assert len(a) == 40 and len({r.request_id for r in a}) == 40
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and times[0] >= 0
    p = tmp_path / "w.jsonl"
    save_jsonl(p, a)
    assert load_jsonl(p) == a


def test_sharegpt_lengths_are_long_tailed() -> None:
    reqs = generate_workload("sharegpt", 4000, seed=0)
    prompts = np.array([r.prompt_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    # LogNormal(ln 110, 0.9): mean 110 * e^0.405 ~ 165, mean > median (right tail)
    assert 150 < prompts.mean() < 180 and np.median(prompts) < prompts.mean()
    assert 300 < outputs.mean() < 360 and outputs.max() > 5 * np.median(outputs)
    assert all(r.arrival_time == 0.0 for r in reqs)


def test_shared_prefix_groups_share_exact_tokens() -> None:
    reqs = generate_workload("shared-prefix", 12, seed=1, num_groups=3, prefix_len=32)
    by_group: dict[str, list[WorkloadRequest]] = {}
    for r in reqs:
        by_group.setdefault(r.prefix_group, []).append(r)
    assert len(by_group) == 3
    for group in by_group.values():
        heads = {tuple(r.prompt_token_ids[:32]) for r in group}
        assert len(heads) == 1
    assert len({tuple(r.prompt_token_ids[:32]) for r in reqs}) == 3


def test_multi_turn_resends_history_with_scripted_replies() -> None:
    reqs = generate_workload("multi-turn", 8, seed=2, num_turns=4, system_prompt_len=20)
    conv = sorted((r for r in reqs if r.prefix_group == "conv0"), key=lambda r: r.request_id)
    assert [r.request_id for r in conv] == [f"conv0-turn{t}" for t in range(4)]
    for prev, nxt in zip(conv, conv[1:], strict=False):
        history = prev.prompt_token_ids + prev.output_token_ids
        assert nxt.prompt_token_ids[: len(history)] == history
        assert nxt.arrival_time >= prev.arrival_time
    other = next(r for r in reqs if r.prefix_group == "conv1")
    assert other.prompt_token_ids[:20] == conv[0].prompt_token_ids[:20]


def test_poisson_rate_and_bad_input(tmp_path) -> None:
    reqs = generate_workload("random", 2000, seed=0, request_rate=10.0)
    assert reqs[-1].arrival_time / 2000 == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError, match="unknown workload kind"):
        generate_workload("zipf", 3)
    with pytest.raises(ValueError, match="unknown options"):
        generate_workload("random", 3, prefix_len=4)
    with pytest.raises(ValueError, match="request_rate"):
        generate_workload("random", 3, request_rate=0)
    with pytest.raises(ValueError, match="prompt_len"):
        WorkloadRequest("x", 3, 1, 0.0, prompt_token_ids=[1, 2])
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_len": 3, "output_len": 2, "arrival_time": 0}\n{"prompt_len": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*missing output_len"):
        load_jsonl(p)


def test_resolved_prompt_ids_are_deterministic_and_unique() -> None:
    a, b = WorkloadRequest("a", 50, 1, 0.0), WorkloadRequest("b", 50, 1, 0.0)
    ids = resolve_prompt_token_ids(a, vocab_size=100)
    assert ids == resolve_prompt_token_ids(a, vocab_size=100) and len(ids) == 50
    assert ids != resolve_prompt_token_ids(b, vocab_size=100)
    assert all(10 <= t < 100 for t in ids)
    assert not math.isnan(sum(ids))


@pytest.mark.parametrize(
    "line, match",
    [
        ('"arrival_time": Infinity', "arrival_time must be a finite number >= 0"),
        ('"arrival_time": 0, "prompt_token_ids": [1, -5, 3]', "prompt_token_ids must be"),
        ('"arrival_time": 0, "prompt_token_ids": ["a", "b", "c"]', "prompt_token_ids must be"),
        ('"arrival_time": 0, "prompt_token_ids": [1.5, 2, 3]', "prompt_token_ids must be"),
        ('"arrival_time": 0, "output_token_ids": [1, null]', "output_token_ids must be"),
    ],
)
def test_bad_values_in_trace_are_named(tmp_path, line: str, match: str) -> None:
    """Token ids that are not ids and an infinite arrival time used to load (an infinite
    duration in simulate, type errors later in bench); now the line is refused."""
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt_len": 3, "output_len": 2, ' + line + "}\n")
    with pytest.raises(ValueError, match=rf"w\.jsonl:1: bad workload line: .*{match}"):
        load_jsonl(p)


def test_empty_trace_file_is_refused(tmp_path) -> None:
    """An empty trace used to replay as zero requests (simulate printed a table of zeros)."""
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no requests"):
        load_jsonl(p)
