"""Steady-state decode allocates (almost) nothing: workspace reuse, counted storages, numerics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.hotpath import StorageCounter, _DecodeDriver
from kvserve.core.outputs import SchedulerOutput
from kvserve.runtime import native
from kvserve.runtime.attention.metadata import SeqSpec, build_attention_metadata
from kvserve.runtime.kv_cache import KVCache
from kvserve.runtime.layer_ops import apply_rope_, rms_norm_into
from kvserve.runtime.model_runner import ModelRunner
from kvserve.runtime.workspace import Workspace
from tests.runtime.runtime_testutil import (
    ToyAllocator,
    generate,
    hf_greedy,
    ours_from_hf,
    tiny_hf_model,
)

BLOCK_SIZE = 4
# Regression guard, measured on the tiny 2-layer model: per decode step the runner's aten ops
# return 5 attention-metadata tensors (mask arithmetic) + the K-then-V gather rows (once per
# step, shared by the layers) + per layer 2 in the attention backend (block gather, SDPA
# output) + final norm output + logits rows + logits + the greedy pick (max values and
# indices: 2; with the native kernels its ids and the rows' finite flags, which are the
# per-request guard's non-finite check) + that check without them (one sum: 1) = 16 fresh
# storages at most,
# whatever the batch size (tensors made by torch.tensor from Python lists bypass aten dispatch
# and are not counted here). Before the workspace it was 47.
MAX_NEW_STORAGES_PER_DECODE_STEP = 16


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model("llama")
    return hf, *ours_from_hf(hf)


def _runner(tiny, num_blocks: int = 96) -> ModelRunner:
    _, model, arch = tiny
    return ModelRunner(model, arch, num_blocks=num_blocks, block_size=BLOCK_SIZE)


def _count_decode_storages(runner: ModelRunner, batch_size: int, num_steps: int = 3) -> list[int]:
    drv = _DecodeDriver(runner, batch_size, prompt_len=9, max_len=9 + 3 + num_steps + 1)
    for _ in range(2):  # warm-up
        drv.step()
    counts = []
    for _ in range(num_steps):
        counter = StorageCounter()

        def observe(sched: SchedulerOutput, counter: StorageCounter = counter) -> object:
            with counter:
                return runner.execute(sched)

        drv.step(observe)
        counts.append(counter.num_new_storages)
    return counts


@pytest.mark.parametrize("batch_size", [1, 4])
def test_warm_decode_step_allocates_a_bounded_number_of_storages(tiny, batch_size) -> None:
    counts = _count_decode_storages(_runner(tiny), batch_size)
    assert len(set(counts)) == 1, counts  # steady state: the same every step
    assert counts[0] <= MAX_NEW_STORAGES_PER_DECODE_STEP, counts


def test_layers_add_no_allocations_beyond_the_attention_backend(tiny) -> None:
    """Counted by op: nothing the decoder layers do themselves (norms, matmuls, RoPE, SwiGLU,
    residual adds) returns a fresh storage once the workspace is warm."""
    runner = _runner(tiny)
    drv = _DecodeDriver(runner, 3, prompt_len=9, max_len=16)
    drv.step()
    counter = StorageCounter()

    def observe(sched: SchedulerOutput) -> object:
        with counter:
            return runner.execute(sched)

    drv.step(observe)
    num_layers = len(runner.model.layers)
    for op in ("addmm", "mul", "add", "cat", "silu", "rsqrt", "cos", "sin"):
        assert counter.by_op.get(op, 0) == 0, (op, counter.by_op)
    # NOTE: one sum per step at most, the sampling guard's non-finite check (runtime/guard.py)
    # where the native argmax does not make it, whatever the number of layers.
    assert counter.by_op.get("sum", 0) == (0 if native.available() else 1), counter.by_op
    # the logits only (the lm_head's Linear allocates its output)
    assert counter.by_op.get("mm", 0) + counter.by_op.get("linear", 0) <= 1, counter.by_op
    assert counter.by_op.get("rms_norm", 0) == 0, counter.by_op
    assert counter.by_op.get("scaled_dot_product_attention", 0) == num_layers


def test_workspace_reuse_gives_identical_logits_to_a_fresh_forward(tiny) -> None:
    """A large step first (buffers bigger than needed), then a smaller ragged step through the
    same workspace: bitwise equal to the same step with fresh buffers, and the returned
    hidden states do not alias the workspace."""
    _, model, arch = tiny
    gen = torch.Generator().manual_seed(3)
    alloc = ToyAllocator(64, BLOCK_SIZE, seed=2)
    caches = [
        KVCache(
            num_layers=arch.num_hidden_layers,
            num_blocks=64,
            block_size=BLOCK_SIZE,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
        )
        for _ in range(2)
    ]
    ws = Workspace()
    outs = []
    for step, lengths in enumerate(([23, 17], [1, 5, 2])):
        specs, ids, pos = [], [], []
        for i, n in enumerate(lengths):
            rid = f"s{i}"
            start = 0 if step == 0 or i == 2 else 23 if i == 0 else 17
            table = alloc.ensure(rid, start + n)
            specs.append(SeqSpec(len(ids), n, start, list(table)))
            ids += torch.randint(0, arch.vocab_size, (n,), generator=gen).tolist()
            pos += range(start, start + n)
        meta = build_attention_metadata(
            specs, block_size=BLOCK_SIZE, device=torch.device("cpu"), dtype=torch.float32
        )
        with torch.inference_mode():
            args = (torch.tensor(ids), torch.tensor(pos))
            reused = model(*args, caches[0].layer_caches, meta, ws)
            fresh = model(*args, caches[1].layer_caches, meta)
        assert torch.equal(reused, fresh), step
        outs.append((reused, reused.clone()))
    first, first_copy = outs[0]
    assert torch.equal(first, first_copy)  # the later step did not overwrite it


def test_runner_with_workspace_still_matches_hf_greedy(tiny) -> None:
    hf = tiny[0]
    gen = torch.Generator().manual_seed(5)
    prompts = {f"p{n}": torch.randint(0, 97, (n,), generator=gen).tolist() for n in (4, 13, 21)}
    ours = generate(_runner(tiny), prompts, 6, token_budget=12)
    for rid, prompt in prompts.items():
        assert ours[rid] == hf_greedy(hf, prompt, 6), rid


def test_rms_norm_into_equals_f_rms_norm_bitwise() -> None:
    gen = torch.Generator().manual_seed(0)
    for num_tokens in (1, 7, 33):
        x = torch.randn(num_tokens, 48, generator=gen)
        w = torch.randn(48, generator=gen)
        out = torch.full_like(x, float("nan"))
        rms_norm_into(x, w, 1e-6, out, Workspace())
        assert torch.equal(out, F.rms_norm(x, (48,), w, 1e-6))


def test_apply_rope_in_place_matches_rotate_half() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 8, generator=gen)
    angle = torch.randn(5, 1, 4, generator=gen)
    cos = torch.cat((angle.cos(), angle.cos()), dim=-1)
    sin_hf = torch.cat((angle.sin(), angle.sin()), dim=-1)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    expected = x * cos + rotate_half * sin_hf
    sin_folded = torch.cat((-angle.sin(), angle.sin()), dim=-1)
    y = x.clone()
    assert apply_rope_(y, cos, sin_folded, torch.empty_like(y)) is y
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)


def test_workspace_grows_only_when_a_step_needs_more() -> None:
    ws = Workspace()
    cpu = torch.device("cpu")
    a = ws.take("x", (4, 8), torch.float32, cpu)
    b = ws.take("x", (2, 8), torch.float32, cpu)
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8)
    c = ws.take("x", (5, 8), torch.float32, cpu)
    assert c.shape == (5, 8) and ws.nbytes == 5 * 8 * 4
    d = ws.take("x", (5, 8), torch.float64, cpu)  # another dtype: a new buffer
    assert d.dtype == torch.float64 and ws.nbytes == 5 * 8 * 8
    assert ws.constant(2.0, torch.float32, cpu) is ws.constant(2.0, torch.float32, cpu)


def test_workspace_hands_out_one_view_per_role_until_the_shape_changes() -> None:
    ws = Workspace()
    cpu = torch.device("cpu")
    a = ws.take("x", (4, 8), torch.float32, cpu)
    assert ws.take("x", (4, 8), torch.float32, cpu) is a  # no tensor ops on a repeat
    b = ws.take("x", (2, 8), torch.float32, cpu)
    assert b.shape == (2, 8) and b.data_ptr() == a.data_ptr()
    c = ws.take("x", (64, 8), torch.float32, cpu)  # grows: a view of the new buffer
    assert c.shape == (64, 8) and ws.take("x", (64, 8), torch.float32, cpu) is c
    d = ws.take("x", (2, 8), torch.float32, cpu)
    assert d.data_ptr() == c.data_ptr()  # not a stale view of the old buffer
    assert ws.take("x", (2, 8), torch.float64, cpu).dtype == torch.float64
