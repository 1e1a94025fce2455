"""Each experiment runs end to end on a small trace, shows its effect, and saves a PNG."""

import argparse
import json

import pytest

from kvserve.sim import cli
from kvserve.sim.calibrate import StepRecord, save_step_records
from kvserve.sim.cost_model import CostModel, Efficiency, StepShape
from kvserve.sim.experiments import run_experiment
from kvserve.sim.hardware import get_hardware
from kvserve.sim.setup import SimSetup
from kvserve.sim.specs import get_model_spec


def _setup(**kw: object) -> SimSetup:
    base = dict(
        model=get_model_spec("llama-3-8b"),
        hardware=get_hardware("h100"),
        max_model_len=2048,
        num_requests=24,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    base.update(kw)
    return SimSetup(**base)  # type: ignore[arg-type]


def _col(res, name: str) -> list:
    i = res.columns.index(name)
    return [r[i] for r in res.rows]


def _png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_paged_vs_contiguous(tmp_path) -> None:
    res = run_experiment("paged-vs-contiguous", _setup(num_kv_blocks=600), str(tmp_path))
    batch, waste = _col(res, "max batch seen"), _col(res, "KV waste (mean)")
    assert _col(res, "batch that fits")[0] == 600 * 16 // 2048
    assert batch[0] <= 600 * 16 // 2048 < batch[1]
    assert waste[0] > 0.5 > waste[1]
    assert _png(res.plot_path)


def test_static_vs_continuous(tmp_path) -> None:
    res = run_experiment("static-vs-continuous", _setup(request_rate=float("inf")), str(tmp_path))
    static, cont = res.rows
    assert static[0] == "static" and cont[0] == "continuous"
    i = res.columns.index("out tok/s")
    assert cont[i] > static[i]
    assert _png(res.plot_path)


def test_chunked_prefill(tmp_path) -> None:
    res = run_experiment("chunked-prefill", _setup(num_requests=30), str(tmp_path))
    labels, itl_max = _col(res, "budget"), _col(res, "ITL max ms")
    assert labels[-1] == "off" and labels[0] == "256"
    # a long prompt in one step stalls decodes for longer than a 256-token chunk does
    assert itl_max[0] < itl_max[-1]
    assert _png(res.plot_path)


def test_prefix_cache(tmp_path) -> None:
    res = run_experiment("prefix-cache", _setup(num_requests=16), str(tmp_path))
    for off, on in (res.rows[0:2], res.rows[2:4]):
        assert off[1] == "off" and on[1] == "on"
        assert off[2] == 0 and on[2] > 0.3
        assert on[3] < off[3] and on[4] < off[4]  # less prefill computed, lower TTFT
    assert _png(res.plot_path)


def test_preemption(tmp_path) -> None:
    res = run_experiment("preemption", _setup(num_requests=20), str(tmp_path))
    modes = _col(res, "mode")
    assert modes == ["recompute", "recompute, no prefix cache", "swap"]
    assert all(p > 0 for p in _col(res, "preemptions"))
    assert _col(res, "swapped GB")[2] > 0 and _col(res, "swapped GB")[0] == 0
    assert _col(res, "recomputed tokens")[0] > 0
    assert _png(res.plot_path)
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("nope", _setup(), str(tmp_path))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def test_cli_prints_kv_header_first_then_replays(capsys, tmp_path) -> None:
    trace = tmp_path / "w.jsonl"
    args = _parse(
        [
            "--model",
            "llama-3-70b",
            "--gpu",
            "h100",
            "--tensor-parallel-size",
            "8",
            "--num-requests",
            "12",
            "--max-model-len",
            "2048",
            "--save-workload",
            str(trace),
        ]
    )
    assert cli.run(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("KV bytes per token: 327,680")
    assert "2,684,354,560 B = 2.68 GB = 2.50 GiB" in out[2]
    assert "343.6 GB = 320.0 GiB" in out[3]
    assert any(line.startswith("| num_finished") and line.endswith(" 12 |") for line in out)
    assert len(trace.read_text().splitlines()) == 12
    assert cli.run(_parse(["--model", "llama-3-8b", "--workload", str(trace)])) == 0


def test_cli_calibrate_and_errors(capsys, tmp_path) -> None:
    cm = CostModel(
        get_model_spec("smollm2-135m"), get_hardware("cpu"), efficiency=Efficiency(0.3, 0.5, 2e-3)
    )
    shapes = [StepShape(p, d, p + d * 300, max(d, 1)) for p in (0, 64, 256) for d in (1, 8, 32)]
    path = tmp_path / "steps.jsonl"
    save_step_records(
        path,
        [
            StepRecord(
                s.num_prefill_tokens,
                s.num_decode_tokens,
                s.num_context_tokens,
                s.num_seqs,
                cm.step_time(s),
            )
            for s in shapes
        ],
    )
    assert (
        cli.run(_parse(["--model", "smollm2-135m", "--gpu", "cpu", "--calibrate", str(path)])) == 0
    )
    out = capsys.readouterr().out
    assert "use: --eff-flops 0.3000 --eff-bandwidth 0.5000 --overhead-ms 2.00" in out
    assert cli.run(_parse(["--gpu", "tpu"])) == 2
    assert "unknown gpu" in capsys.readouterr().err
    path.write_text(json.dumps({"seconds": 1}) + "\n")
    assert cli.run(_parse(["--calibrate", str(path)])) == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-kv-blocks", "0"], "num_kv_blocks must be >= 1, got 0"),
        (["--num-kv-blocks", "-5"], "num_kv_blocks must be >= 1, got -5"),
        (["--max-model-len", "0"], "max_model_len must be >= 1, got 0"),
        (["--max-model-len", "16384"], "max_model_len 16384 exceeds Llama-3-8B's context 8192"),
        (["--swap-space-gib", "nan"], "swap_space_gib must be a finite number >= 0, got nan"),
        (["--swap-space-gib", "inf"], "swap_space_gib must be a finite number >= 0, got inf"),
        (
            ["--tensor-parallel-size", "3"],
            "tensor parallel degree 3 must divide Llama-3-8B's 32 attention heads",
        ),
        (["--seed", "-1"], "seed must be >= 0, got -1"),
    ],
)
def test_cli_rejects_impossible_setup(capsys, flags: list[str], message: str) -> None:
    """Values that used to be silently replaced by the default (0 blocks, 0 length), run as
    given (a length beyond the model's context, a TP degree splitting a head) or fail with a
    message naming no flag (a NaN swap space) are refused before anything is printed."""
    assert cli.run(_parse(["--num-requests", "4", *flags])) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_cli_takes_the_engine_flag_names() -> None:
    """``--tensor-parallel-size`` and ``--swap-space`` (bytes) as the engine spells them; the
    old ``--tp`` and ``--swap-space-gib`` still parse but are not in the help."""
    setup = cli.build_setup(_parse(["--tensor-parallel-size", "4", "--swap-space", "8GiB"]))
    assert (setup.tp, setup.swap_space_gib) == (4, 8.0)
    assert cli.build_setup(_parse([])).swap_space_gib == 16.0
    old = cli.build_setup(_parse(["--tp", "2", "--swap-space-gib", "4"]))
    assert (old.tp, old.swap_space_gib) == (2, 4.0)
    parser = argparse.ArgumentParser(prog="kvserve simulate")
    cli.add_arguments(parser)
    text = parser.format_help()
    assert "--tensor-parallel-size" in text and "--swap-space SWAP_SPACE" in text
    assert "--tp " not in text and "--swap-space-gib" not in text


def test_cli_rejects_a_swap_space_that_is_not_bytes(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["--swap-space", "lots"])
    assert "not a byte size: 'lots'" in capsys.readouterr().err
