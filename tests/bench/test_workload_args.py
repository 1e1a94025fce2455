import argparse

import pytest

from kvserve.bench.workload_args import add_workload_args, build_workload, check_vocab
from kvserve.sim.workloads import load_jsonl


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--workload", "random", "--input-len", "16", "--output-len", "8"],
        ["--workload", "sharegpt", "--num-prompts", "5"],
        ["--workload", "shared-prefix", "--num-groups", "2", "--prefix-len", "32"],
        ["--workload", "multi-turn", "--num-turns", "3", "--num-prompts", "6"],
    ],
)
def test_same_seed_same_trace_and_every_prompt_resolved(argv: list[str]) -> None:
    a = build_workload(_args(*argv, "--workload-seed", "5"))
    b = build_workload(_args(*argv, "--workload-seed", "5"))
    c = build_workload(_args(*argv, "--workload-seed", "6"))
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    for r in a:
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == r.prompt_len
        assert all(10 <= t < 32000 for t in r.prompt_token_ids)


def test_random_fixed_lengths_and_jsonl_round_trip(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    argv = ["--input-len", "12", "--output-len", "7", "--num-prompts", "4"]
    reqs = build_workload(_args(*argv, "--save-workload", str(path), "--vocab-size", "500"))
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(12, 7)}
    assert all(max(r.prompt_token_ids) < 500 for r in reqs)
    loaded = load_jsonl(path)
    assert [r.to_dict() for r in loaded] == [r.to_dict() for r in reqs]
    replayed = build_workload(_args("--workload-file", str(path), "--vocab-size", "500"))
    assert [r.to_dict() for r in replayed] == [r.to_dict() for r in reqs]


def test_sharegpt_max_output_len_clips_the_tail_only() -> None:
    full = build_workload(_args("--workload", "sharegpt", "--num-prompts", "64"))
    clipped = build_workload(
        _args("--workload", "sharegpt", "--num-prompts", "64", "--max-output-len", "200")
    )
    assert max(r.output_len for r in full) > 200  # the default tail reaches past the clip
    assert [min(r.output_len, 200) for r in full] == [r.output_len for r in clipped]
    assert [r.prompt_len for r in full] == [r.prompt_len for r in clipped]
    with pytest.raises(ValueError, match="--max-output-len applies to --workload sharegpt"):
        build_workload(_args("--workload", "random", "--max-output-len", "8"))


def test_shared_prefix_groups_share_their_prefix() -> None:
    reqs = build_workload(
        _args(
            "--workload",
            "shared-prefix",
            "--num-prompts",
            "6",
            "--num-groups",
            "2",
            "--prefix-len",
            "20",
            "--suffix-len",
            "4",
        )
    )
    g0 = [r.prompt_token_ids[:20] for r in reqs if r.prefix_group == "g0"]
    g1 = [r.prompt_token_ids[:20] for r in reqs if r.prefix_group == "g1"]
    assert len(g0) == 3 and all(p == g0[0] for p in g0)
    assert all(p == g1[0] for p in g1) and g0[0] != g1[0]


def test_check_vocab_names_the_request() -> None:
    reqs = build_workload(_args("--num-prompts", "2", "--input-len", "8", "--output-len", "2"))
    check_vocab(reqs, 32000)
    with pytest.raises(ValueError, match="req-0.*vocab size 100"):
        check_vocab(reqs, 100)


def test_bad_workload_file_line_raises(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1.*missing"):
        build_workload(_args("--workload-file", str(path)))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--workload", "sharegpt", "--input-len", "16"], "--input-len"),
        (["--workload", "random", "--num-groups", "2"], "--num-groups"),
        (["--workload", "multi-turn", "--output-len", "8"], "--output-len"),
        (["--workload", "shared-prefix", "--num-turns", "3"], "--num-turns"),
        (["--workload-file", "w.jsonl", "--output-len", "8"], "--output-len"),
    ],
)
def test_flag_the_trace_does_not_use_is_refused(argv: list[str], flag: str) -> None:
    """A length flag of another workload kind (or with --workload-file) used to be ignored
    silently; now it is an error naming the flag, as --max-output-len already was."""
    with pytest.raises(ValueError, match=rf"{flag} applies to --workload [\w /-]+, not "):
        build_workload(_args(*argv))
