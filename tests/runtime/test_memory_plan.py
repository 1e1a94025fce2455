"""Activation planner: the interval packer on hand-made and random lifetimes, the dispatch
recorder on small torch programs, and one trace of the embedded model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime.memory_plan.arena import Interval, live_bytes_lower_bound, pack_intervals
from kvserve.runtime.memory_plan.planner import plan_activations, worst_case_steps
from kvserve.runtime.memory_plan.recorder import LifetimeRecorder

# ------------------------------------------------------------------------ packer, by hand


def test_disjoint_lifetimes_share_one_slot() -> None:
    ivs = [Interval(0, 1, 100), Interval(2, 3, 100), Interval(4, 5, 100)]
    plan = pack_intervals(ivs, alignment=1)
    plan.check()
    assert plan.offsets == (0, 0, 0)
    assert plan.peak_bytes == plan.lower_bound_bytes == 100
    assert plan.naive_bytes == 300


def test_overlapping_lifetimes_get_disjoint_bytes() -> None:
    ivs = [Interval(0, 5, 10), Interval(2, 3, 20), Interval(3, 8, 30)]
    plan = pack_intervals(ivs, alignment=1)
    plan.check()
    assert plan.peak_bytes == plan.lower_bound_bytes == 60
    spans = sorted((o, o + iv.size) for o, iv in zip(plan.offsets, ivs, strict=True))
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start


def test_inclusive_end_means_touching_intervals_do_overlap() -> None:
    # [0, 2] and [2, 4] are both live at op 2; [0, 2] and [3, 4] never are.
    assert live_bytes_lower_bound([Interval(0, 2, 8), Interval(2, 4, 8)]) == 16
    assert live_bytes_lower_bound([Interval(0, 2, 8), Interval(3, 4, 8)]) == 8


def test_best_fit_takes_the_tightest_hole() -> None:
    # Early buffers A [0, 100) and D [190, 270) die at op 2; C and F live on. The late
    # buffer N (75 bytes) may go into A's hole (100 bytes, first fit) or D's (80): best fit
    # takes D's.
    ivs = [
        Interval(0, 2, 100, "A"),
        Interval(0, 9, 90, "C"),
        Interval(0, 2, 80, "D"),
        Interval(0, 9, 78, "F"),
        Interval(3, 9, 75, "N"),
    ]
    plan = pack_intervals(ivs, alignment=1)
    plan.check()
    assert plan.offsets == (0, 100, 190, 270, 190)
    assert plan.peak_bytes == plan.lower_bound_bytes == 348


def test_alignment_rounds_offsets_and_sizes() -> None:
    plan = pack_intervals([Interval(0, 3, 10), Interval(1, 2, 70), Interval(2, 5, 1)], 64)
    plan.check()
    assert all(o % 64 == 0 for o in plan.offsets)
    assert plan.naive_bytes == 64 + 128 + 64
    assert plan.peak_bytes == plan.lower_bound_bytes == 256


def test_zero_sized_and_empty_inputs() -> None:
    assert pack_intervals([]).peak_bytes == 0
    plan = pack_intervals([Interval(0, 0, 0), Interval(0, 1, 5)], alignment=1)
    plan.check()
    assert plan.peak_bytes == 5


@pytest.mark.parametrize(
    ("interval", "what"),
    [(Interval(3, 2, 1), "end=2"), (Interval(-1, 2, 1), "start=-1"), (Interval(0, 1, -5), "-5")],
)
def test_invalid_intervals_are_rejected(interval: Interval, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        pack_intervals([interval])


def test_check_catches_a_broken_plan() -> None:
    plan = pack_intervals([Interval(0, 2, 8), Interval(1, 3, 8)], alignment=1)
    broken = type(plan)(
        plan.intervals, (0, 0), plan.alignment, 16, plan.naive_bytes, plan.lower_bound_bytes
    )
    with pytest.raises(AssertionError, match="overlap in time and memory"):
        broken.check()


# ------------------------------------------------------------------------ packer, random

intervals_st = st.lists(
    st.tuples(
        st.integers(0, 40), st.integers(0, 15), st.integers(0, 5000), st.sampled_from([1, 64])
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(intervals_st, st.sampled_from([1, 8, 64]))
def test_random_plans_are_valid_and_within_bounds(raw: list, alignment: int) -> None:
    ivs = [Interval(s, s + d, size * unit) for s, d, size, unit in raw]
    plan = pack_intervals(ivs, alignment=alignment)
    plan.check()  # no two live-together intervals overlap in memory; offsets aligned
    assert plan.lower_bound_bytes <= plan.peak_bytes <= plan.naive_bytes
    assert plan.lower_bound_bytes == live_bytes_lower_bound(ivs, alignment)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 4096)), max_size=40))
def test_equal_lifetimes_pack_exactly(raw: list) -> None:
    # Everything live at once: the only valid plans stack the buffers, peak = sum = bound.
    ivs = [Interval(0, 5, size) for _, size in raw]
    plan = pack_intervals(ivs, alignment=1)
    plan.check()
    assert plan.peak_bytes == plan.lower_bound_bytes == plan.naive_bytes


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4096), max_size=40))
def test_a_chain_of_temporaries_needs_two_slots(sizes: list) -> None:
    # y_i = f(y_{i-1}): each buffer overlaps only its neighbours, so the lower bound is the
    # largest neighbouring pair, and largest-first greedy reaches it.
    ivs = [Interval(i, i + 1, s) for i, s in enumerate(sizes)]
    plan = pack_intervals(ivs, alignment=1)
    plan.check()
    assert plan.peak_bytes >= plan.lower_bound_bytes
    if len(sizes) <= 3:
        assert plan.peak_bytes == plan.lower_bound_bytes


# ------------------------------------------------------------------------------ recorder


def test_recorder_sees_allocations_views_and_last_uses() -> None:
    rec = LifetimeRecorder()
    with rec:
        a = torch.ones(4, 8)  # op 0: 128 bytes
        b = a.view(32)  # a view: no buffer, but a use of a's buffer
        c = torch.relu(b)  # op 2: 128 bytes, reads a's buffer
        c.add_(1)  # in place: no buffer, a use of c
        d = c.sum()  # reads c
        del a, b
    sizes = [buf.size for buf in rec.buffers]
    assert sizes == [128, 128, 4]
    ivs = rec.intervals()
    assert ivs[0].start == 0 and ivs[0].end == ivs[1].start  # a lives until relu reads it
    assert ivs[1].end == ivs[2].start  # c lives until sum reads it
    eager = rec.intervals(eager=True)
    assert eager[1].end == rec.num_ops - 1  # c is still referenced at the end
    assert d.item() > 0


def test_recorder_ignores_tensors_from_before_the_step() -> None:
    weight = torch.randn(16, 16)
    rec = LifetimeRecorder()
    with rec:
        x = torch.zeros(2, 16)
        y = x @ weight.T  # weight.T is a view of an outside tensor: nothing allocated
        weight.mul_(1.0)  # writing into an outside tensor allocates nothing
    assert [buf.size for buf in rec.buffers] == [2 * 16 * 4, 2 * 16 * 4]
    assert y.shape == (2, 16)


# ------------------------------------------------------------------------ model traces


def test_worst_case_steps_respect_the_scheduler_limits() -> None:
    steps = worst_case_steps(
        max_num_batched_tokens=48, max_num_seqs=8, max_model_len=100, block_size=16
    )
    assert set(steps) == {"prefill", "decode", "mixed"}
    for sched in steps.values():
        assert sched.total_num_scheduled_tokens <= 48
        assert len(sched.scheduled) <= 8
        for r in sched.scheduled:
            assert r.start_pos + r.num_tokens == 100  # every sequence at max_model_len
            assert len(r.block_ids) * 16 >= 100
    with pytest.raises(ValueError, match="max_num_seqs"):
        worst_case_steps(max_num_batched_tokens=4, max_num_seqs=0, max_model_len=8, block_size=4)
    # Speculation: at most 7 requests draft 4 tokens each, so 5 rows each; the budget of 48
    # tokens holds 9 such requests, max_num_seqs 8, the speculating ones 7.
    spec = worst_case_steps(
        max_num_batched_tokens=48,
        max_num_seqs=8,
        max_model_len=100,
        block_size=16,
        speculative=(7, 4),
    )["speculate"]
    assert [len(r.token_ids) for r in spec.scheduled] == [5] * 7
    assert all(r.spec_token_ids == [0] * 4 and r.sample for r in spec.scheduled)


@pytest.fixture(scope="module")
def embedded_arch():  # type: ignore[no-untyped-def]
    from kvserve.models.gguf_loader import gguf_arch_config
    from kvserve.models.gguf_reader import read_gguf
    from kvserve.models.loader import default_model_path

    return gguf_arch_config(read_gguf(default_model_path()))


def test_plan_of_the_embedded_model(embedded_arch) -> None:  # type: ignore[no-untyped-def]
    arch = embedded_arch
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 4, "max_model_len": 64, "steps": ["mixed"]}
    kw["model_factory"] = LlamaForCausalLM
    plan = plan_activations(arch, **kw)
    plan.arena.check()
    assert plan.num_layers_traced == arch.num_hidden_layers
    assert plan.lower_bound_bytes <= plan.planned_peak_bytes < plan.naive_bytes
    # Sampling rows' fp32 logits are live at the peak, at least once.
    assert plan.lower_bound_bytes >= 4 * arch.vocab_size * 4
    # Layers are identical: two of them show the same peak as all thirty.
    two = plan_activations(arch, **kw, max_layers=2)
    assert two.num_layers_traced == 2
    assert two.planned_peak_bytes == plan.planned_peak_bytes
    assert two.naive_bytes < plan.naive_bytes


def test_batched_decode_gather_grows_with_max_model_len(embedded_arch) -> None:  # type: ignore[no-untyped-def]
    # The SDPA decode path gathers every sequence's blocks, padded to the longest: that
    # gather is [2, seqs * blocks, block_size, kvh, d] per layer and sets the decode step's
    # peak. (The native decode kernel reads the blocks in place: see test_native.py.)
    arch = embedded_arch
    kw = {
        "max_num_batched_tokens": 8, "max_num_seqs": 8, "steps": ["decode"], "max_layers": 2,
        "attn_backend": "torch_sdpa", "model_factory": LlamaForCausalLM,
    }  # fmt: skip
    short = plan_activations(arch, max_model_len=256, **kw)
    long = plan_activations(arch, max_model_len=2048, **kw)
    gather = 2 * 8 * 2048 * arch.num_key_value_heads * arch.head_dim * 4
    assert long.lower_bound_bytes >= gather
    assert short.lower_bound_bytes < gather
    assert long.planned_peak_bytes > short.planned_peak_bytes + gather // 2


def test_the_speculative_step_sizes_the_logits_of_every_draft_row(embedded_arch) -> None:  # type: ignore[no-untyped-def]
    """Each draft row samples: 7 requests x 9 rows of fp32 logits are live at the
    speculative step's peak, and that step outgrows every step without speculation."""
    kw = {
        "max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 64, "max_layers": 1,
        "model_factory": LlamaForCausalLM,
    }  # fmt: skip
    plain = plan_activations(embedded_arch, **kw)
    spec = plan_activations(embedded_arch, **kw, speculative=(7, 8))
    assert spec.step_name == "speculate"
    assert spec.lower_bound_bytes >= 7 * 9 * embedded_arch.vocab_size * 4
    assert spec.reserve_bytes > plain.reserve_bytes
