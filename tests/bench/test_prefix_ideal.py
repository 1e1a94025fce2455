"""The ideal prefix hit rate ``bench prefix`` compares the engine against."""

from __future__ import annotations

import pytest

from kvserve.bench.prefix import ideal_hit_rate


def test_no_sharing_is_zero() -> None:
    assert ideal_hit_rate([[1, 2, 3], [4, 5, 6]]) == 0.0
    assert ideal_hit_rate([]) == 0.0


def test_token_level_reuse_is_capped_one_short() -> None:
    # The second prompt shares 4 tokens; the third repeats the first exactly and can
    # reuse at most len - 1 = 5 of its 6 tokens.
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6]]
    assert ideal_hit_rate(prompts) == pytest.approx((0 + 4 + 5) / 17)


def test_reuse_comes_from_the_best_earlier_prompt_only() -> None:
    # The last prompt shares 2 tokens with the first and 3 with the second; later prompts
    # never count as sources.
    prompts = [[1, 2, 7, 7], [1, 2, 3, 8], [1, 2, 3, 9]]
    assert ideal_hit_rate(prompts) == pytest.approx((0 + 2 + 3) / 12)


def test_block_aligned_rounds_down_and_drops_a_full_last_block() -> None:
    prompts = [list(range(8)), list(range(7)) + [99], list(range(8))]
    # Shares 7 -> 1 block of 4; the exact repeat of 8 tokens = 2 blocks, gives up the last.
    assert ideal_hit_rate(prompts, block_size=4) == pytest.approx((0 + 4 + 4) / 24)
    with pytest.raises(ValueError, match="block_size"):
        ideal_hit_rate(prompts, block_size=0)
