"""Host offload tier of the prefix cache, end to end (issue 7, item 4).

A multi-turn workload whose histories exceed the device KV pool but fit in the host tier:
with the tier on, evicted history blocks are loaded back instead of recomputed, so the
prefix hit rate is higher; greedy outputs must be token-identical to the tier-off run.
TTFT is measured and printed (run with ``-s``), never asserted; so are the measured load
and offload times and the load-vs-recompute ratio (asserted below 1 only: the margin is wide).
"""

from __future__ import annotations

import pytest

from kvserve.sampling_params import SamplingParams
from tests.e2e.prompts import QUESTIONS, SYSTEM

NUM_TURNS = 3
NUM_KV_BLOCKS = 12  # 192 tokens: about one conversation's history at turn 3; there are 6
NUM_HOST_BLOCKS = 120  # all six histories fit
# NOTE: few output tokens keep the test fast (each decode step is a full forward pass).
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
FOLLOW_UPS = ["Why is that so?", "Say it again, more briefly please."]
# NOTE: a distinct context per conversation, so most of each history is its own (the
# shared system prompt alone would be a device hit with or without the tier).
CONTEXT = (
    "Conversation {i}. Here are some notes I wrote down earlier today about topic number {i}; "
    "please keep them in mind: the meeting moved to room {i}0{i}, the budget is {i}{i}00 "
    "euros, and the deadline is the {i}th of next month, so plan around that."
)


def _run_conversations(llm) -> tuple[list[list[int]], dict]:
    """Turn by turn, every conversation re-sends its whole history plus a new question.

    One request at a time (max_num_seqs=1), conversations in turn, so by the time a
    conversation comes back the other five have pushed its history out of the device pool.
    Returns every turn's output token ids and the engine's stats.
    """
    tok = llm.tokenizer
    histories = [
        tok.apply_chat_template(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": CONTEXT.format(i=i + 1) + " " + q},
            ]
        )
        for i, q in enumerate(QUESTIONS)
    ]
    outputs: list[list[int]] = []
    for turn in range(NUM_TURNS):
        outs = llm.generate(histories, GREEDY, use_tqdm=False)
        for i, out in enumerate(outs):
            ids = out.outputs[0].token_ids
            outputs.append(ids)
            if turn + 1 < NUM_TURNS:
                follow_up = (
                    f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UPS[turn]}<|im_end|>\n"
                    "<|im_start|>assistant\n"
                )
                histories[i] = histories[i] + ids + tok.encode(follow_up, add_special_tokens=False)
    return outputs, llm.stats()


def test_host_tier_raises_hit_rate_and_keeps_greedy_outputs(make_llm) -> None:
    common = dict(num_kv_blocks=NUM_KV_BLOCKS, block_size=16, max_num_seqs=1)
    off = make_llm(**common)
    swap_space = NUM_HOST_BLOCKS * 16 * off.engine.kv_bytes_per_token
    off_outputs, off_stats = _run_conversations(off)
    del off
    on = make_llm(**common, swap_space=swap_space, enable_host_prefix_cache=True)
    on_outputs, on_stats = _run_conversations(on)

    assert on_outputs == off_outputs
    assert on_stats["prefix_cache_queries"] == off_stats["prefix_cache_queries"]
    assert on_stats["host_hit_tokens"] > 0 and on_stats["load_blocks"] > 0
    assert on_stats["offload_blocks"] > 0
    assert on_stats["prefix_hit_rate"] > off_stats["prefix_hit_rate"] + 0.2
    assert (
        on_stats["prefix_cache_hits"] == on_stats["device_hit_tokens"] + on_stats["host_hit_tokens"]
    )
    assert off_stats["host_hit_tokens"] == off_stats["offload_blocks"] == 0
    assert on_stats["kv_usage"] == 0
    on.engine.kv_cache_manager.check_integrity()
    # Load vs recompute: the runner timed every block the manager planned to move, and
    # loading a block back was measured against the prefill time its tokens would cost.
    assert on_stats["host_load_blocks"] == on_stats["load_blocks"]
    assert on_stats["host_offload_blocks"] == on_stats["offload_blocks"]
    assert on_stats["host_load_tokens"] == on_stats["host_hit_tokens"]
    assert on_stats["host_load_seconds"] > 0 and on_stats["host_offload_seconds"] > 0
    assert off_stats["host_load_seconds"] == off_stats["host_offload_seconds"] == 0
    assert on_stats["prefill_seconds_per_token"] > 0
    assert on_stats["host_load_recompute_seconds"] == pytest.approx(
        on_stats["host_load_tokens"] * on_stats["prefill_seconds_per_token"]
    )
    # NOTE: a timing comparison, kept only because the margin is wide: loading costs tens of
    # microseconds a token (a 46 KB copy), its prefill milliseconds (ratio 0.007 measured on
    # 2 loaded cores, see README); the assertion allows 1.0, over 100x that.
    assert on_stats["host_tier_load_vs_recompute"] < 1.0
    block_bytes = 16 * on.engine.kv_bytes_per_token
    print(
        f"\nhost tier off: prefix_hit_rate={off_stats['prefix_hit_rate']:.3f} "
        f"ttft_mean={off_stats['ttft']['mean'] * 1e3:.1f} ms\n"
        f"host tier on:  prefix_hit_rate={on_stats['prefix_hit_rate']:.3f} "
        f"ttft_mean={on_stats['ttft']['mean'] * 1e3:.1f} ms "
        f"(device hits {on_stats['device_hit_tokens']} tokens, host hits "
        f"{on_stats['host_hit_tokens']} tokens; offloaded "
        f"{on_stats['offload_blocks'] * block_bytes / 2**20:.1f} MiB, loaded "
        f"{on_stats['load_blocks'] * block_bytes / 2**20:.1f} MiB)\n"
        f"host tier on:  load {on_stats['host_load_seconds'] * 1e3:.1f} ms for "
        f"{on_stats['host_load_tokens']} tokens "
        f"({on_stats['host_load_seconds_per_token'] * 1e6:.1f} us/token), offload "
        f"{on_stats['host_offload_seconds'] * 1e3:.1f} ms; prefill "
        f"{on_stats['prefill_seconds_per_token'] * 1e3:.2f} ms/token, so recomputing the "
        f"loaded tokens ~{on_stats['host_load_recompute_seconds'] * 1e3:.0f} ms; "
        f"load/recompute = {on_stats['host_tier_load_vs_recompute']:.4f}"
    )
