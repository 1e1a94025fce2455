"""The Triton kernels (``runtime/attention/triton``) under ``TRITON_INTERPRET=1`` on CPU
tensors, against the exact torch reference (``TorchReferenceBackend``).

Hypothesis draws block sizes (powers of two and not), GQA ratios, head sizes, ragged batches
of decodes and chunks (each with history in the cache), windows with sinks (freed blocks
read as ``NULL_BLOCK_ID``), int8 / fp8 caches, split-K and the query tile size. The
interpreter runs every program in Python: the sizes stay small and the examples few.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.config import ATTENTION_BACKEND_CHOICES
from kvserve.runtime.attention import ATTENTION_BACKENDS
from kvserve.runtime.attention.metadata import NULL_BLOCK_ID, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.triton.plan import build_step_plan, choose_num_splits
from kvserve.runtime.kv_cache import KVCache, quantize_kv

# NOTE: TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports triton.
pytest.importorskip("triton")

from kvserve.runtime.attention.triton.kv_write import write_kv  # noqa: E402
from tests.runtime.triton_cases import make_seqs, run_both  # noqa: E402

CPU = torch.device("cpu")
FEW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def attention_cases(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([1, 3, 4, 5, 8, 16]))
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    return {
        "bs": bs,
        "kvh": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2, 3, 4, 8])),
        "d": draw(st.sampled_from([4, 8, 12])),
        "kind": draw(st.sampled_from(["auto", "int8", "fp8"])),
        "window": window,
        "sinks": draw(st.integers(0, 3)) if window is not None else 0,
        # (new tokens, cached tokens): decodes and chunks, with or without history
        "specs": draw(
            st.lists(st.tuples(st.integers(1, 6), st.integers(0, 40)), min_size=1, max_size=3)
        ),
        "launch": {
            "num_splits": draw(st.sampled_from([None, 1, 3])),
            "block_m": draw(st.sampled_from([None, 16])),
        },
        "seed": draw(st.integers(0, 1000)),
    }


@FEW
@given(case=attention_cases())
def test_triton_attention_matches_torch_ref(case: dict) -> None:
    want, got, ref_cache, tri_cache = run_both(case, CPU)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the K/V write: the same bytes (and scales) as the reference wrote
    assert torch.equal(tri_cache.device_cache, ref_cache.device_cache)
    if ref_cache.device_scales is not None:
        assert torch.equal(tri_cache.device_scales, ref_cache.device_scales)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_kv_write_quantizes_as_kv_cache_does(kind: str) -> None:
    """Edge rows: all zeros (also -0.0), tiny, huge, fp8 binade edges and subnormals."""
    rows = torch.tensor(
        [
            [0.0, -0.0, 0.0, 0.0],
            [1e-30, -2e-30, 3e-30, 0.0],
            [1e30, -1e30, 5e29, 1.0],
            [126.92, 448.0, -0.5, 0.001],
            [448.0, 0.0137, 0.0146, -0.0013],
            [127.0, 0.5, 1.5, -2.5],
        ]
    ).view(6, 1, 4)
    cache = KVCache(
        num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=4, kv_cache_dtype=kind
    )
    slots = torch.tensor([0, 5, 2, 7, 3, 1])
    write_kv(cache.layer_caches[0], slots, rows, -rows)
    layer = cache.layer_caches[0]
    for i, x in ((0, rows), (1, -rows)):
        data, scales = quantize_kv(x, kind)
        assert torch.equal(layer.data[i].reshape(8, 1, 4)[slots], data)
        assert torch.equal(layer.scales[i].reshape(8, 1)[slots], scales)


def test_long_decode_splits_its_keys_and_matches() -> None:
    """A decode of 600 positions (the plan's own split-K choice) against the reference."""
    case = {
        "bs": 16,
        "kvh": 1,
        "group": 2,
        "d": 8,
        "kind": "auto",
        "window": None,
        "sinks": 0,
        "specs": [(1, 599)],
        "launch": {},
        "seed": 3,
    }
    seqs, _ = make_seqs(case["specs"], 16, None, 0, 3)
    meta = build_attention_metadata(seqs, block_size=16, device=CPU, dtype=torch.float32)
    assert build_step_plan(meta, 2, 1, CPU).num_splits > 1
    want, got, _, _ = run_both(case, CPU)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_step_plan_tiles_and_tables() -> None:
    """Decodes are one tile each, a chunk is cut into tiles of block_m // group rows, and the
    tables keep freed entries (the kernel reads block 0 for them, masked)."""
    seqs = [
        SeqSpec(0, 1, 4, [7, 2]),
        SeqSpec(1, 9, 0, [3, 4, 5]),
        SeqSpec(10, 1, 8, [NULL_BLOCK_ID, 6, 1]),
    ]
    meta = build_attention_metadata(seqs, block_size=4, device=CPU, dtype=torch.float32)
    plan = build_step_plan(meta, num_heads=6, num_kv_heads=2, device=CPU, block_m=16)
    assert (plan.block_m, plan.block_q) == (16, 5)
    assert plan.tile_seq.tolist() == [0, 1, 1, 2]
    assert plan.tile_start.tolist() == [0, 1, 6, 10]
    assert plan.query_start.tolist() == [0, 1, 10, 11]
    assert plan.seq_lens.tolist() == [5, 9, 9]
    assert plan.block_table.tolist() == [[7, 2, 0], [3, 4, 5], [NULL_BLOCK_ID, 6, 1]]
    # a GQA group wider than 16 rows widens the tile to the group
    wide = build_step_plan(meta, num_heads=32, num_kv_heads=1, device=CPU, block_m=16)
    assert (wide.block_m, wide.block_q) == (32, 1)


def test_split_choice() -> None:
    assert choose_num_splits(num_programs=4, max_seq_len=100) == 1  # too short to split
    assert choose_num_splits(num_programs=4096, max_seq_len=8192) == 1  # the device is full
    assert choose_num_splits(num_programs=8, max_seq_len=8192) == 16
    assert choose_num_splits(num_programs=128, max_seq_len=8192) == 4


def test_backend_choices_match_the_config() -> None:
    assert ATTENTION_BACKEND_CHOICES == ATTENTION_BACKENDS
