"""Random paged-attention steps run through ``torch_ref`` and ``triton`` side by side (the
Triton kernel tests here under the interpreter, and ``tests/cuda`` compiled on a GPU)."""

from __future__ import annotations

import torch

from kvserve.runtime.attention.metadata import NULL_BLOCK_ID, SeqSpec, build_attention_metadata
from kvserve.runtime.attention.torch_ref import TorchReferenceBackend
from kvserve.runtime.attention.triton.backend import TritonBackend
from kvserve.runtime.kv_cache import KVCache, quantize_kv


def _cache(
    kind: str,
    num_blocks: int,
    bs: int,
    kvh: int,
    d: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> KVCache:
    """A one-layer cache filled with random (quantized) K/V, as earlier steps would leave it."""
    cache = KVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=bs,
        num_kv_heads=kvh,
        head_dim=d,
        kv_cache_dtype=kind,
        device=device,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(2, num_blocks, bs, kvh, d, generator=gen).to(device)
    layer = cache.layer_caches[0]
    if kind == "auto":
        layer.copy_(values.to(dtype))
    else:
        data, scales = quantize_kv(values, kind)
        layer.data.copy_(data)
        layer.scales.copy_(scales)
    return cache


def make_seqs(specs: list[tuple[int, int]], bs: int, window: int | None, sinks: int, seed: int):
    """SeqSpecs of (new tokens, tokens already cached) over shuffled distinct blocks; with a
    window, blocks no query of the step can see are freed (``NULL_BLOCK_ID``)."""
    counts = [-(-(start + n) // bs) for n, start in specs]
    ids = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, offset = [], 0
    for (n, start), count in zip(specs, counts, strict=True):
        table, ids = ids[:count], ids[count:]
        if window is not None:
            for j in range(count):
                if j * bs >= sinks and (j + 1) * bs - 1 <= start - window:
                    table[j] = NULL_BLOCK_ID
        seqs.append(SeqSpec(offset, n, start, table))
        offset += n
    return seqs, sum(counts)


def run_both(
    case: dict, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, KVCache, KVCache]:
    """Run torch_ref and triton on ``case``'s step over the same cache; returns both outputs
    and both caches (reference first)."""
    bs, kvh, group, d, kind = case["bs"], case["kvh"], case["group"], case["d"], case["kind"]
    window, sinks = case["window"], case["sinks"]
    seqs, num_blocks = make_seqs(case["specs"], bs, window, sinks, case["seed"])
    num_tokens = sum(n for n, _ in case["specs"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(num_tokens, kvh * group, d, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, kvh, d, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, kvh, d, generator=gen).to(device, dtype)
    results = []
    for backend in (TorchReferenceBackend(), TritonBackend(**case["launch"])):
        cache = _cache(kind, num_blocks, bs, kvh, d, case["seed"], device, dtype)
        meta = build_attention_metadata(
            seqs,
            block_size=bs,
            device=device,
            dtype=dtype,
            sliding_window=window,
            num_sink_tokens=sinks,
        )
        results.append((backend.forward(q, k, v, cache.layer_caches[0], meta), cache))
    (want, ref_cache), (got, tri_cache) = results
    return want, got, ref_cache, tri_cache
