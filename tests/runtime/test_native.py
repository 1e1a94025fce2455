"""Native CPU kernels: each op against the torch ops it replaces, the decode kernel against
dense attention (hypothesis), bad input, tracing, and the fallback when they are off."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.rope import rope_cos_sin
from kvserve.runtime import native
from kvserve.runtime.attention import get_attention_backend
from kvserve.runtime.attention.metadata import NULL_BLOCK_ID, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.native_cpu import NativeCPUBackend
from kvserve.runtime.attention.sdpa import TorchSDPABackend
from kvserve.runtime.layer_ops import apply_rope_, rms_norm_into
from kvserve.runtime.workspace import Workspace

CPU = torch.device("cpu")
DISABLED = os.environ.get(native.DISABLE_ENV) == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason=f"{native.DISABLE_ENV}=0")


def test_kernels_build_and_load() -> None:
    """CI has g++: the kernels must load there (else every native test below would pass
    through the torch fallback and test nothing)."""
    assert native.load(), native.reason()
    assert native.build_dir().is_dir()
    assert isinstance(get_attention_backend("auto"), NativeCPUBackend)


def _ops():
    assert native.load(), native.reason()
    return native.ops()


# ------------------------------------------------------------------------ per-layer ops
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 576, generator=gen) * 3
    residual = torch.randn(rows, 576, generator=gen)
    weight = torch.rand(576, generator=gen) + 0.5
    expected_hidden = hidden + residual if with_residual else hidden.clone()
    expected = torch.empty_like(hidden)
    rms_norm_into(expected_hidden.clone(), weight, 1e-5, expected, Workspace())
    out = torch.empty_like(hidden)
    _ops().add_rms_norm(hidden, residual if with_residual else None, weight, 1e-5, out)
    assert torch.equal(hidden, expected_hidden)  # the residual add is the same float add
    # NOTE: only the sum of squares differs (accumulated in double): a few ulp.
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)


def test_add_rms_norm_may_write_over_its_residual() -> None:
    """The model passes the o-projection buffer as both residual and out."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen)
    expected = F.rms_norm(hidden + x, (64,), weight, 1e-6)
    _ops().add_rms_norm(hidden, x, weight, 1e-6, x)
    torch.testing.assert_close(x, expected, rtol=2e-6, atol=1e-6)


def test_add_rms_norm_bfloat16() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 128, generator=gen).bfloat16()
    weight = torch.rand(128, generator=gen).bfloat16()
    out = torch.empty_like(hidden)
    _ops().add_rms_norm(hidden, None, weight, 1e-6, out)
    expected = F.rms_norm(hidden.float(), (128,), weight.float(), 1e-6)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_bfloat16_rounding_is_torchs() -> None:
    """The kernels' branch-free float -> bf16 rounding (round to nearest even, NaN stays NaN)
    gives torch's bits: the residual add of add_rms_norm is one rounded float add."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(3, 512, generator=gen) * 100).bfloat16()
    residual = torch.randn(3, 512, generator=gen).bfloat16()
    # exact ties (the sum's low 16 bits are 0x8000 with an even / odd upper half), overflow,
    # infinities and a NaN
    hidden[0, :6] = torch.tensor([1.0, 1.0078125, 3e38, float("inf"), -float("inf"), 1.0])
    residual[0, :6] = torch.tensor([2.0**-8, 2.0**-8, 3e38, 1.0, 1.0, float("nan")])
    expected = hidden.float() + residual.float()  # exact in float, rounded once below
    _ops().add_rms_norm(
        hidden, residual, torch.ones(512).bfloat16(), 1e-6, torch.empty_like(hidden)
    )
    finite = ~expected.isnan()
    assert torch.equal(
        hidden[finite].view(torch.int16), expected.bfloat16()[finite].view(torch.int16)
    )
    assert hidden[~finite].isnan().all()


@pytest.mark.parametrize("rows", [1, 33])
def test_rope_matches_torch_on_a_strided_view(rows: int) -> None:
    """q and k are views into the fused qkv buffer: rows strided, heads contiguous."""
    heads, kv_heads, d = 9, 3, 64
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    expected = qkv.clone()
    qk_ref = expected[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    apply_rope_(qk_ref, cos, sin, torch.empty(rows, heads + kv_heads, d))
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    _ops().rope_(qk, cos, sin)
    torch.testing.assert_close(qkv, expected, rtol=0, atol=2e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], expected[:, (heads + kv_heads) * d :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_in_place_over_the_gate_half(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(6, 2 * 1536, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # exp under/overflow edges
    inter = 1536
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    gate = gate_up[:, :inter]
    _ops().silu_mul(gate, gate_up)
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(gate, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_does_not_depend_on_where_in_the_row(dtype: torch.dtype) -> None:
    """Widths around the 8- and 16-lane kernels' steps: the tail elements (masked or padded)
    get the bits the same values get in a full vector step, and match torch."""
    gen = torch.Generator().manual_seed(11)
    values = (torch.randn(40, generator=gen) * 6).to(dtype)
    ups = torch.randn(40, generator=gen).to(dtype)
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    results = {}
    for inter in (1, 7, 8, 9, 15, 17, 19, 25, 33, 40):
        gate_up = torch.cat([values[:inter], ups[:inter]]).unsqueeze(0)  # [1, 2 x inter]
        out = torch.empty(1, inter, dtype=dtype)
        _ops().silu_mul(out, gate_up)
        results[inter] = out[0]
        expected = F.silu(values[:inter].float()) * ups[:inter].float()
        torch.testing.assert_close(out[0].float(), expected, **tol)
    for inter, out in results.items():
        assert torch.equal(out, results[40][:inter]), inter


def test_write_kv_puts_each_token_at_its_slot() -> None:
    cache = torch.zeros(2, 6, 4, 2, 8)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 5 * 16, generator=gen)  # k and v as strided views
    k = qkv[:, 16:32].view(3, 2, 8)
    v = qkv[:, 32:48].view(3, 2, 8)
    slots = torch.tensor([23, 0, 9])
    _ops().write_kv(cache, k, v, slots)
    flat = cache.view(2, 24, 2, 8)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[0, slot], k[i]) and torch.equal(flat[1, slot], v[i])
    assert int((flat.abs().sum((2, 3)) > 0).sum()) == 6  # nothing else written


# --------------------------------------------------------------------- decode attention
def _dense(q, keys, values, seq_len, window, sinks):
    """Reference for one decode query q [H, d] at position seq_len - 1."""
    group = q.shape[0] // keys.shape[1]
    keys = keys[:seq_len].repeat_interleave(group, 1)  # [L, H, d]
    values = values[:seq_len].repeat_interleave(group, 1)
    scores = torch.einsum("hd,khd->hk", q.double(), keys.double()) / math.sqrt(q.shape[-1])
    pos = torch.arange(seq_len)
    allowed = pos <= seq_len - 1
    if window is not None:
        allowed &= (pos > seq_len - 1 - window) | (pos < sinks)
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("hk,khd->hd", probs, values.double()).float()


def _decode_case(lens, block_size, num_heads, num_kv_heads, head_dim, window, sinks, dtype, seed):
    """A paged cache with shuffled block tables (blocks out of the window freed to -1), the
    queries, and the dense reference: (q, cache, tables, seq_lens, expected [B, H, d])."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    flat = cache.float().view(2, -1, num_kv_heads, head_dim)
    width = max(-(-n // block_size) for n in lens)
    tables, expected = [], []
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    for b, n in enumerate(lens):
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        keys, values = flat[0, slots], flat[1, slots]
        expected.append(_dense(q[b].float(), keys, values, n, window, sinks))
        if window is not None:  # free the blocks nobody can see any more
            for i in range(len(table)):
                if i * block_size >= sinks and (i + 1) * block_size <= n - window:
                    table[i] = NULL_BLOCK_ID
        tables.append(table + [0] * (width - len(table)))
    tables = torch.tensor(tables, dtype=torch.int32)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), torch.stack(expected)


def _decode(q, cache, tables, seq_lens, window, sinks, threads):
    """paged_decode_attention's output with ``threads`` threads."""
    out = torch.empty_like(q)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _ops().paged_decode_attention(
            out, q, cache, tables, seq_lens, 1.0 / math.sqrt(q.shape[-1]), window or 0, sinks
        )
    finally:
        torch.set_num_threads(previous)
    return out


def _decode_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """bf16: only the output's rounding to bf16 (2^-9 relative) beyond float32's error."""
    return {"rtol": 0, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-4}


@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=9),
    block_size=st.sampled_from([1, 4, 16]),
    # NOTE: float32 and bf16 groups of 1-8 heads take the wide kernels: with head_dim 64 on
    # AVX-512 CPUs, 8, 64 and 80 on AVX2-only ones, where AVX-512 CPUs take the v8f group
    # kernels for 8 and 80; 16 heads per KV head and head_dim 12 take the per-head loops.
    heads=st.sampled_from([(2, 2), (6, 2), (9, 3), (8, 1), (14, 2), (16, 1)]),
    head_dim=st.sampled_from([8, 12, 64, 80]),
    window=st.sampled_from([None, 1, 5, 24]),
    sinks=st.integers(0, 6),
    threads=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_attention_matches_dense(
    lens, block_size, heads, head_dim, window, sinks, threads, dtype, seed
) -> None:
    """Shuffled block tables, GQA/MQA groups, windows with sinks and freed (-1) blocks.

    bf16 (the kernels widen K/V rows on load or multiply bf16 pairs in float) is compared with
    the dense reference on the same bf16 inputs.
    """
    num_heads, num_kv_heads = heads
    q, cache, tables, seq_lens, expected = _decode_case(
        lens, block_size, num_heads, num_kv_heads, head_dim, window, sinks, dtype, seed
    )
    out = _decode(q, cache, tables, seq_lens, window, sinks, threads)
    torch.testing.assert_close(out.float(), expected, **_decode_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 64, 96, 128])
@pytest.mark.parametrize("group", range(1, 9))
def test_decode_attention_every_group_of_the_wide_kernels(group, head_dim, dtype) -> None:
    """Every group size and head_dim % 8 == 0, the shapes of the wide kernels (decode_seq_wide).

    AVX-512 CPUs take head_dim % 32 == 0 (their V pass takes 64 columns at a time for head_dim
    % 64 == 0 and up to 4 heads, else 32), AVX2-only ones every head_dim here (16 columns at a
    time for head_dim % 16 == 0 and up to 3 heads, else 8). The K pass scores 16 (AVX2: 8)
    visible rows at a time: lengths around multiples of 8 and 16, then blocks of 5 and a
    window edge inside a block, so that the groups straddle blocks."""
    for lens, block_size, window, sinks in (
        ([1, 7, 8, 9, 15, 16, 17, 47], 16, None, 0),
        ([40, 33, 70], 5, 21, 3),
    ):
        q, cache, tables, seq_lens, expected = _decode_case(
            lens, block_size, 2 * group, 2, head_dim, window, sinks, dtype, seed=group + head_dim
        )
        out = _decode(q, cache, tables, seq_lens, window, sinks, threads=1)
        torch.testing.assert_close(out.float(), expected, **_decode_tolerance(dtype))


# The second batch is long-tailed: one sequence holds most of the work.
@pytest.mark.parametrize("lens", [[70, 5, 33, 16, 1, 64, 20, 48], [300, 1, 2, 3, 4, 5, 6, 7, 2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [12, 64, 80])
@pytest.mark.parametrize("window", [None, 24])
def test_decode_attention_does_not_depend_on_the_batch_or_threads(
    head_dim, dtype, window, lens
) -> None:
    """Each sequence's output bit for bit, alone or in a batch, with 1-3 threads (a task is
    one KV head of a sequence or a whole sequence; the threads split the tasks by their
    positions, so with the long tail a thread may get none): the engine's equivalence tests
    rely on it. head_dim 64, 80 and 12 take the three kinds of kernels (see above)."""
    q, cache, tables, seq_lens, _ = _decode_case(lens, 16, 9, 3, head_dim, window, 2, dtype, 3)
    reference = _decode(q, cache, tables, seq_lens, window, 2, threads=1)
    for threads in (1, 2, 3):
        assert torch.equal(_decode(q, cache, tables, seq_lens, window, 2, threads), reference)
        for b in range(len(lens)):
            one = slice(b, b + 1)
            alone = _decode(q[one], cache, tables[one], seq_lens[one], window, 2, threads)
            assert torch.equal(alone, reference[one]), (b, threads)


def test_decode_attention_bfloat16_close_to_float32() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 8, 4, 2, 64, generator=gen)
    q = torch.randn(3, 6, 64, generator=gen)
    tables = torch.tensor([[3, 1, 0], [7, 2, 5], [4, 6, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 12, 5], dtype=torch.int32)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(q.shape, dtype=dtype)
        _ops().paged_decode_attention(out, q.to(dtype), cache.to(dtype), tables, lens, 0.125, 0, 0)
        outs.append(out.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=3e-2)


def _decode_args(**changes):
    args = {
        "out": torch.empty(2, 4, 8),
        "q": torch.randn(2, 4, 8),
        "kv_cache": torch.randn(2, 5, 4, 2, 8),
        "block_tables": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "seq_lens": torch.tensor([5, 8], dtype=torch.int32),
        "scale": 0.35,
        "sliding_window": 0,
        "num_sink_tokens": 0,
    }
    args.update(changes)
    return list(args.values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seq_lens": torch.tensor([5, 9], dtype=torch.int32)}, r"seq_lens\[1\] = 9"),
        ({"seq_lens": torch.tensor([5, 8])}, "seq_lens must be a contiguous int32"),
        ({"block_tables": torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)}, "7 is visible"),
        ({"block_tables": torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)}, "-1 is visible"),
        ({"q": torch.randn(2, 4, 8).double()}, "must share a dtype"),
        ({"q": torch.randn(2, 3, 8), "out": torch.empty(2, 3, 8)}, "don't fit the cache"),
        ({"kv_cache": torch.randn(2, 5, 4, 2, 8)[:, ::2]}, "contiguous"),
    ],
)
def test_decode_attention_rejects_bad_input(changes, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _ops().paged_decode_attention(*_decode_args(**changes))


def test_write_kv_rejects_out_of_range_slot() -> None:
    cache = torch.zeros(2, 2, 4, 1, 8)
    k = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        _ops().write_kv(cache, k, k, torch.tensor([8]))


# ------------------------------------------------------------------------- the backend
def test_backend_falls_back_to_sdpa_for_quantized_caches() -> None:
    """Same metadata and inputs: an int8 cache takes TorchSDPABackend's path verbatim."""
    from kvserve.runtime.kv_cache import KVCache

    gen = torch.Generator().manual_seed(6)
    seqs = [SeqSpec(0, 1, 6, [2, 0]), SeqSpec(1, 3, 0, [1])]
    meta = build_attention_metadata(
        seqs, block_size=4, device=torch.device("cpu"), dtype=torch.float32
    )
    q = torch.randn(4, 4, 8, generator=gen)
    k = torch.randn(4, 2, 8, generator=gen)
    v = torch.randn(4, 2, 8, generator=gen)
    outs = []
    for backend in (NativeCPUBackend(), TorchSDPABackend()):
        cache = KVCache(
            num_layers=1,
            num_blocks=4,
            block_size=4,
            num_kv_heads=2,
            head_dim=8,
            kv_cache_dtype="int8",
        )
        outs.append(backend.forward(q, k, v, cache.layer_caches[0], meta))
    assert torch.equal(outs[0], outs[1])


def test_kernels_off_by_environment_fall_back_to_torch() -> None:
    code = """
from kvserve.config import ModelArchConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime import native
from kvserve.runtime.attention import get_attention_backend

print(native.available(), native.reason())
print(type(get_attention_backend("auto")).__name__)
arch = ModelArchConfig("llama", 64, 32, 64, 1, 4, 2, 8, 64)
print(LlamaForCausalLM(arch).native_ops)
attempts = (
    lambda: get_attention_backend("native"),
    lambda: LlamaForCausalLM(arch, native_ops=True),
)
for attempt in attempts:
    try:
        attempt()
    except ValueError as e:
        print(e)
"""
    env = {**os.environ, native.DISABLE_ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "False disabled by KVSERVE_NATIVE=0",
        "TorchSDPABackend",
        "False",
        "attention backend 'native' is unavailable: disabled by KVSERVE_NATIVE=0",
        "native CPU kernels unavailable: disabled by KVSERVE_NATIVE=0",
    ]


def test_memory_plan_traces_the_native_ops_and_counts_their_scratch() -> None:
    from kvserve.config import ModelArchConfig
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.runtime.kernel_scratch import native_decode_scratch_bytes
    from kvserve.runtime.memory_plan.planner import plan_activations

    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64,
    )  # fmt: skip
    plan = plan_activations(
        arch, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=64, block_size=4,
        steps=["decode"], num_threads=2, attn_backend="native", model_factory=LlamaForCausalLM,
    )  # fmt: skip
    # The decode step's 8 sequences of up to 64 tokens (16 blocks): one scratch per thread.
    assert plan.kernel_scratch_bytes == native_decode_scratch_bytes(4, 64, 8, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_first_max_with_nan_maximal(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(7, 1000, generator=gen).to(dtype)
    logits[1, [30, 600]] = 50.0  # a tie: the first wins
    logits[2, [999, 5]] = float("nan")  # NaN is maximal: the first NaN
    logits[3] = -float("inf")  # all -inf -> 0
    logits[4, 999] = float("inf")
    logits[5, 0] = 80.0  # at the edges
    logits[6, 999] = 80.0
    out = torch.empty(7, dtype=torch.long)
    _ops().argmax_rows(out, logits)
    assert out.tolist() == logits.max(dim=-1).indices.tolist()
    assert out.tolist()[:4] == [out[0].item(), 30, 5, 0]
    finite = torch.empty(7, dtype=torch.bool)
    _ops().argmax_rows(out, logits, finite)
    assert out.tolist() == logits.max(dim=-1).indices.tolist()
    assert finite.tolist() == [True, True, False, False, False, True, True]
    with pytest.raises(RuntimeError, match="out must be a contiguous int64"):
        _ops().argmax_rows(torch.empty(7, dtype=torch.int32), logits)
    with pytest.raises(RuntimeError, match="finite must be a contiguous bool tensor of 7"):
        _ops().argmax_rows(out, logits, torch.empty(6, dtype=torch.bool))


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 70),
    num_values=st.integers(1, 4),
    specials=st.lists(
        st.tuples(st.sampled_from(["nan", "inf", "-inf"]), st.integers(0, 69)), max_size=4
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_argmax_rows_over_vector_tails_and_late_specials(
    seed: int, n: int, num_values: int, specials: list[tuple[str, int]], dtype: torch.dtype
) -> None:
    """Rows shorter and longer than a 16-lane vector, ties across lanes and vectors, a NaN or
    an infinity anywhere (the one-pass kernel keeps a maximum and its first index per lane);
    the rows' finite flags from the same pass (float16 takes the portable loop)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, num_values, (4, n), generator=gen).float()  # [4, n]
    logits[3] = -float("inf")
    for k, (value, col) in enumerate(specials):
        logits[k % 3, col % n] = float(value)
    logits = logits.to(dtype)
    out = torch.empty(4, dtype=torch.long)
    finite = torch.empty(4, dtype=torch.bool)
    _ops().argmax_rows(out, logits, finite)
    assert out.tolist() == logits.max(dim=-1).indices.tolist()
    assert finite.tolist() == torch.isfinite(logits).all(dim=-1).tolist()
