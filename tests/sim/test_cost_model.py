"""The roofline cost model on hand-computed cases."""

import pytest

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sim.cost_model import CostModel, Efficiency, StepShape
from kvserve.sim.hardware import HardwareSpec, get_hardware
from kvserve.sim.specs import ModelSpec, get_model_spec

# 2 layers, hidden 8, 2 heads (1 KV head) of dim 4, MLP 16, vocab 10, fp16.
# attn/layer = 8*(8+2*4) + 8*8 = 192; mlp = 3*8*16 = 384; norms 16 -> 592/layer, body 1184.
TINY = ModelSpec("tiny", 2, 8, 2, 1, 4, 16, 10, dtype="float16")
ONE = Efficiency(flops=1.0, bandwidth=1.0, overhead_s=0.5)


def _hw(peak_flops: float, link: float = 0.0, latency: float = 0.0) -> HardwareSpec:
    return HardwareSpec("toy", 1e9, 1000.0, peak_flops, link, 64.0, latency, max_tp=8)


DECODE4 = StepShape(0, 4, 100, 4, num_attention_pairs=100, num_sampled=4)


def test_tiny_counts() -> None:
    assert TINY.num_params == 1184 + 80 + 80 + 8
    assert TINY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32


def test_hand_computed_decode_step() -> None:
    cm = CostModel(TINY, _hw(1000.0), efficiency=ONE)
    assert cm.linear_flops(DECODE4) == 2 * 1184 * 4 + 2 * 80 * 4  # 10112
    assert cm.attention_flops(DECODE4) == 4 * 2 * 2 * 4 * 100  # 6400
    assert cm.weight_bytes_streamed(DECODE4) == (1184 + 80 + 8 + 4 * 8) * 2  # 2608
    assert cm.kv_bytes_moved(DECODE4) == (100 + 4) * 32  # 3328
    c = cm.breakdown(DECODE4)
    assert c.compute_s == pytest.approx(16.512) and c.memory_s == pytest.approx(5.936)
    assert c.bound == "compute" and c.total_s == pytest.approx(16.512 + 0.5)
    fast = CostModel(TINY, _hw(10_000.0), efficiency=ONE).breakdown(DECODE4)
    assert fast.bound == "memory" and fast.total_s == pytest.approx(5.936 + 0.5)
    half = CostModel(TINY, _hw(10_000.0), efficiency=Efficiency(1.0, 0.5, 0.0))
    assert half.step_time(DECODE4) == pytest.approx(2 * 5.936)


def test_tensor_parallel_and_swap_terms() -> None:
    cm = CostModel(TINY, _hw(10_000.0, link=100.0, latency=0.01), tp=2, efficiency=ONE)
    # message 4 tokens x 8 x 2 B = 64 B; ring: 2*(2-1)/2 * 64/100 = 0.64 s + 0.01, x2 x 2 layers
    assert cm.allreduce_time(DECODE4) == pytest.approx(4 * 0.65)
    # 1 KV head cannot be split: KV bytes stay whole per GPU, weights halve
    assert cm.bytes_per_gpu(DECODE4) == pytest.approx(2608 / 2 + 3328)
    swap = StepShape(0, 4, 100, 4, 100, 4, num_swap_blocks=3)
    assert cm.breakdown(swap).swap_s == pytest.approx(3 * 16 * 32 / 64.0)
    assert CostModel(TINY, _hw(1.0)).step_time(StepShape(0, 0, 0, 0)) == 0.0


def test_shape_from_scheduler_output() -> None:
    sp = SamplingParams(max_tokens=4)
    prefill = ScheduledRequest("a", list(range(5)), 0, [0], False, sp, list(range(9)), [])
    decode = ScheduledRequest("b", [7], 10, [1], True, sp, list(range(8)), [1, 2])
    s = StepShape.from_scheduler_output(
        SchedulerOutput([prefill, decode], blocks_to_swap_in=[(0, 1)], blocks_to_copy=[(1, 2)])
    )
    assert (s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs) == (5, 1, 2)
    assert s.num_context_tokens == 5 + 11
    assert s.num_attention_pairs == 15 + 11 and s.num_sampled == 1
    assert (s.num_swap_blocks, s.num_copy_blocks) == (1, 1)


def test_attention_pair_estimate_is_exact_for_pure_cases() -> None:
    assert StepShape(0, 3, 300, 3).attention_pairs() == 300
    assert StepShape(64, 0, 64, 1).attention_pairs() == 64 * 65 / 2


def test_roofline_regimes_on_70b_h100() -> None:
    cm = CostModel(get_model_spec("llama-3-70b"), get_hardware("h100"), tp=8)
    decode = cm.breakdown(StepShape(0, 64, 64 * 1000, 64))
    prefill = cm.breakdown(StepShape(4096, 0, 4096, 1))
    assert decode.bound == "memory" and prefill.bound == "compute"
    # decode at batch 64: ~141 GB / 8 of weights at 0.8 x 3.35 TB/s ~ 6.6 ms, plus KV
    assert 5e-3 < decode.memory_s < 10e-3
    # attention work quadratic in context: 2x the prompt -> ~4x the attention FLOPs
    a1 = cm.attention_flops(StepShape(4096, 0, 4096, 1))
    a2 = cm.attention_flops(StepShape(8192, 0, 8192, 1))
    assert a2 / a1 == pytest.approx(4.0, rel=1e-3)


def test_moe_streams_only_touched_experts() -> None:
    cm = CostModel(get_model_spec("mixtral-8x7b"), get_hardware("h100"), tp=2)
    one = cm.weight_bytes_streamed(StepShape(0, 1, 10, 1))
    many = cm.weight_bytes_streamed(StepShape(0, 256, 2560, 256))
    assert one < 0.4 * many
    assert many == pytest.approx(cm.model.weight_bytes - cm.model.embedding_params * 2, rel=0.01)
