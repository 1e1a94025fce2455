"""``TritonLayerOps`` (fused residual-add + RMSNorm, RoPE, SiLU x up) under
``TRITON_INTERPRET=1`` on CPU tensors, against ``TorchLayerOps``."""

from __future__ import annotations

import pytest
import torch

from kvserve.models.rope import compute_inv_freq, rope_cos_sin
from kvserve.runtime.layer_ops import TORCH_OPS, RopeViews
from kvserve.runtime.workspace import Workspace

# NOTE: TRITON_INTERPRET=1 is set by tests/conftest.py before anything imports triton.
pytest.importorskip("triton")

from kvserve.runtime.triton_ops.ops import TRITON_OPS  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 40, generator=gen).to(dtype)
    residual = torch.randn(5, 40, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype)
    outs = []
    for ops in (TORCH_OPS, TRITON_OPS):
        h = hidden.clone()
        out = torch.empty_like(h)
        r = residual.clone() if residual is not None else None
        outs.append((ops.add_rms_norm(h, r, weight, 1e-5, out, Workspace()), h))
    (want, want_h), (got, got_h) = outs
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    if dtype == torch.float32:
        assert torch.equal(got_h, want_h)  # the residual stream: the same sum
    else:
        # NOTE: the interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest even,
        # as torch does): one bf16 ulp apart at most here.
        torch.testing.assert_close(got_h, want_h, atol=0, rtol=2**-7)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_add_rms_norm_may_write_into_the_residual() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden, residual = torch.randn(3, 24, generator=gen), torch.randn(3, 24, generator=gen)
    weight = torch.ones(24)
    want = TORCH_OPS.add_rms_norm(
        hidden.clone(), residual.clone(), weight, 1e-6, torch.empty(3, 24), Workspace()
    )
    got = TRITON_OPS.add_rms_norm(hidden.clone(), residual, weight, 1e-6, residual, Workspace())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch_on_the_qkv_views(dtype: torch.dtype) -> None:
    """RoPE on the q and k heads of a fused [T, (H + 2 kvh) * d] projection, in place."""
    num_tokens, heads, kv_heads, d = 4, 3, 1, 8
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(
        compute_inv_freq(d, 10000.0, None), torch.arange(7, 7 + num_tokens), dtype
    )
    results = []
    for ops in (TORCH_OPS, TRITON_OPS):
        buf = qkv.clone()
        x = buf.view(num_tokens, heads + 2 * kv_heads, d)[:, : heads + kv_heads]
        ops.rope_(RopeViews.of(x, torch.empty_like(x).contiguous()), cos, sin)
        results.append(buf)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(results[1], results[0], atol=tol, rtol=tol)
    # V is untouched
    assert torch.equal(results[1][:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


def test_silu_mul_matches_torch_across_column_blocks() -> None:
    gen = torch.Generator().manual_seed(3)
    inter = 1500  # more than one kernel block per row
    gate_up = torch.randn(2, 2 * inter, generator=gen)
    want = TORCH_OPS.silu_mul(
        gate_up.clone()[:, :inter], gate_up[:, inter:], gate_up.clone(), torch.empty(2, inter)
    )
    got = TRITON_OPS.silu_mul(
        gate_up[:, :inter], gate_up[:, inter:], gate_up, torch.empty(2, inter)
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
