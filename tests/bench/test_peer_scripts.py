"""The stdlib-only helpers of bench/peers (no peer is run here)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvserve.bench.plots import concurrency
from kvserve.bench.workload_args import finalize
from kvserve.sim.workloads import generate_workload, save_jsonl

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"

TABLE = """
main: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = 0, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.586 |   218.58 |    1.218 |   105.12 |    1.803 |   141.98 |
|   128 |    128 |    8 |   2048 |    4.500 |   227.56 |    7.400 |   138.38 |   11.900 |   172.10 |
"""


def _load(name: str):  # noqa: ANN202
    sys.path.insert(0, str(PEERS))
    try:
        spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS))


def test_llama_batched_bench_table_becomes_records(tmp_path) -> None:
    mod = _load("llama_batched_bench")
    rows = mod.parse_table(TABLE)
    assert [int(r["B"]) for r in rows] == [1, 8]
    assert rows[1]["T s"] == pytest.approx(11.9) and rows[0]["S_TG t/s"] == pytest.approx(105.12)
    rec_mod = _load("peer_record")
    rec = rec_mod.throughput_record("llama.cpp", "x", 8, 8 * 128, 8 * 128, rows[1]["T s"], 8)
    assert rec["results"]["output_tokens_per_s"] == pytest.approx(1024 / 11.9)
    path = rec_mod.write(rec, str(tmp_path), "r")
    assert concurrency(json.loads(Path(path).read_text())) == 8


def test_peer_prompts_are_the_trace_prompts(tmp_path) -> None:
    trace = finalize(generate_workload("random", 3, 1, min_prompt_len=4, max_prompt_len=6), 999)
    save_jsonl(tmp_path / "w.jsonl", trace)
    prompts = _load("peer_record").load_prompts(str(tmp_path / "w.jsonl"), 2)
    assert prompts == [(r.prompt_token_ids, r.output_len) for r in trace[:2]]
    unresolved = tmp_path / "u.jsonl"
    unresolved.write_text('{"prompt_len": 3, "output_len": 2, "arrival_time": 0}\n')
    with pytest.raises(ValueError, match="bench workload"):
        _load("peer_record").load_prompts(str(unresolved))


def test_llama_cpp_agreement_kl_over_a_partition_bounds_the_full_kl() -> None:
    """The top-K KL the llama.cpp comparison prints is the full KL when K is the vocabulary,
    and below it (data processing) when the rest of the vocabulary is one bucket."""
    import torch

    mod = _load("llama_cpp_agreement")
    gen = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(50, generator=gen) * 3, dim=-1)
    got = torch.log_softmax(ref + 0.3 * torch.randn(50, generator=gen), dim=-1)
    full = float((ref.exp() * (ref - got)).sum())
    every = mod.partition_kl(ref, list(range(50)), got.tolist())
    assert every == pytest.approx(full, rel=1e-5)
    top = got.topk(5)
    coarse = mod.partition_kl(ref, top.indices.tolist(), top.values.tolist())
    assert 0 < coarse < full
    assert mod.partition_kl(ref, top.indices.tolist(), ref[top.indices].tolist()) == pytest.approx(
        0.0, abs=1e-9
    )
