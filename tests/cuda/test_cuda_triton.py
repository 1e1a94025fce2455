"""The Triton backend compiled on a CUDA device (skipped without one; a lent GPU machine runs
it with ``TRITON_INTERPRET=0``, see ``bench/cuda/check.sh``).

What the CPU tests check under the interpreter, here on the GPU: the kernels against
``torch_ref`` (float32 with TF32 off, bfloat16, int8 / fp8 caches, windows, split-K), and
the engine: ``auto`` takes triton, and its greedy tokens equal ``torch_sdpa``'s.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
pytest.importorskip("triton")

CUDA = torch.device("cuda")
CASES = [
    # block size, KV heads, GQA group, head dim, cache, window, sinks, (new, cached) per seq
    (16, 2, 3, 64, "auto", None, 0, [(1, 40), (1, 7), (9, 0), (5, 30)]),
    (16, 1, 8, 128, "int8", None, 0, [(1, 700), (3, 100)]),
    (5, 2, 2, 64, "fp8", 24, 4, [(1, 90), (17, 33)]),
    (32, 3, 1, 64, "auto", 48, 0, [(1, 1000), (1, 3), (64, 64)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_match_torch_ref_on_the_gpu(case: tuple, dtype: torch.dtype) -> None:
    from tests.runtime.triton_cases import run_both

    bs, kvh, group, d, kind, window, sinks, specs = case
    spec = dict(bs=bs, kvh=kvh, group=group, d=d, kind=kind, window=window, sinks=sinks)
    spec.update(specs=specs, launch={}, seed=5)
    want, got, ref_cache, tri_cache = run_both(spec, CUDA, dtype)
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(tri_cache.device_cache, ref_cache.device_cache)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("cuda-triton"),
        "llama",
        num_hidden_layers=3,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.1,
    )


def test_auto_takes_triton_and_matches_sdpa_on_the_gpu(model_dir: str) -> None:
    prompts = [[200 + 3 * j for j in range(n)] for n in (5, 37, 70, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for backend in ("auto", "torch_sdpa"):
        llm = LLM(
            model_dir,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_batched_tokens=32,
        )
        want = "triton" if backend == "auto" else backend
        assert llm.engine.runner.model.attn_backend.name == want
        assert llm.engine.runner.model.ops.name == "triton"  # the layer ops on CUDA
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[backend] = [list(o.outputs[0].token_ids) for o in outs]
    assert out["auto"] == out["torch_sdpa"]


def test_triton_layer_ops_match_torch_on_the_gpu() -> None:
    from kvserve.runtime.layer_ops import TORCH_OPS
    from kvserve.runtime.triton_ops.ops import TRITON_OPS
    from kvserve.runtime.workspace import Workspace

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(33, 576, generator=gen, device="cuda").to(dtype)
        residual = torch.randn(33, 576, generator=gen, device="cuda").to(dtype)
        weight = torch.rand(576, generator=gen, device="cuda").to(dtype)
        outs = []
        for ops in (TORCH_OPS, TRITON_OPS):
            h = hidden.clone()
            out = ops.add_rms_norm(h, residual, weight, 1e-5, torch.empty_like(h), Workspace())
            outs.append((out, h))
        assert torch.equal(outs[0][1], outs[1][1])  # the same rounded residual stream
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=tol, rtol=tol)


def test_greedy_sampling_crosses_to_the_host_once() -> None:
    """An all-greedy batch on the GPU: one host sync (the ids and finite flags together)."""
    import warnings

    from kvserve.runtime.sampler import Sampler
    from tests.runtime.sampler_helpers import make_req

    sampler = Sampler(1000, 0)
    logits = torch.randn(32, 1000, device="cuda")
    reqs = [make_req(f"r{i}", SamplingParams(temperature=0.0)) for i in range(32)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sampler.sample_greedy_checked(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out is not None and out[0] == logits.argmax(dim=-1).tolist() and out[2] == []
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_decode_graphs_replay_what_eager_steps_compute(model_dir: str) -> None:
    """Captured decode steps (the default on CUDA with triton) give the eager tokens;
    ``enforce_eager`` captures none."""
    prompts = [[300 + 5 * j for j in range(n)] for n in (3, 20, 41, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out, activations = {}, {}
    for eager in (False, True):
        llm = LLM(
            model_dir,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            enforce_eager=eager,
            num_kv_blocks=64,
            max_model_len=256,
            max_num_seqs=8,
        )
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        report = llm.engine.memory_report
        activations[eager] = report.activation_bytes
        if graphs is not None:
            assert sorted(graphs.graphs) == [1, 2, 4, 8]
            plan = report.activation_plan
            assert plan is not None
            # the graphs' arena is reserved before the KV pool is sized
            assert report.activation_bytes == plan.reserve_bytes + plan.peaks_by_step["decode"]
            print(f"decode graphs: {graphs.pool_bytes} bytes captured")
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[eager] = [list(o.outputs[0].token_ids) for o in outs]
    assert out[False] == out[True]
    assert activations[False] > activations[True]
