"""Windowed KV eviction with attention sinks (StreamingLLM), as an opt-in block manager.

A windowed request keeps the K/V of its first ``num_sink_tokens`` positions and of the last
``window`` positions; the query at position p attends to keys k <= p with k < S or
k > p - W. Every later query has a position >= ``num_computed_tokens``, so once a block's
tokens all lie in ``[S, num_computed_tokens - W]`` no query will ever read it again: it is
freed back to the pool and its block-table entry becomes ``NULL_BLOCK_ID`` (-1), so every
other position keeps its slot (``block_ids[p // block_size]``).

Positions stay absolute: RoPE was applied at write time with each token's true position and
queries use their true positions; nothing is re-rotated when blocks leave.

Eviction is an accuracy change (a fact in the middle of a long context is gone once its block
leaves): it is off unless the engine sets ``kv_window``; measure it (``kvserve bench
accuracy``).

``WindowedKVCacheManager`` is a ``KVCacheManager`` that overrides one hook,
``_skipped_blocks`` (the out-of-window block indices); the base ``remove_skipped_blocks``,
which the scheduler calls for every request it scheduled, frees them and puts the pool's
null block (id ``NULL_BLOCK_ID``) in their table entries. The base manager's rules for
skipped entries apply:

- Prefix caching is off: a freed block cannot be part of a cached full prefix.
- ``swap_out`` of a table with freed blocks returns None (as if the host tier were full), so
  the scheduler preempts such a request by recompute.
- ``free``, ``fork``, ``snapshot`` and ``check_integrity`` skip the null entries; the
  integrity check also requires them to lie out of the window.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvserve.core.kv.block_pool import NULL_BLOCK_ID
from kvserve.core.kv.kv_cache_config import KVCacheConfig, KVWindow
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.metrics import kv_utilization
from kvserve.request import Request

__all__ = [
    "NULL_BLOCK_ID",
    "KVWindow",
    "WindowedKVCacheManager",
    "kv_utilization_windowed",
    "out_of_window_blocks",
]


def out_of_window_blocks(
    num_computed_tokens: int, num_sink_tokens: int, window: int, block_size: int
) -> range:
    """Block indices no query at a position >= ``num_computed_tokens`` can see.

    Block i holds positions [i * bs, (i + 1) * bs); it is out of the window when all of
    them are >= ``num_sink_tokens`` and <= ``num_computed_tokens - window``.
    """
    first = -(-num_sink_tokens // block_size)
    end = max(0, num_computed_tokens - window + 1) // block_size
    return range(first, max(first, end))


def kv_utilization_windowed(tables: Iterator[tuple[list[int], int]], block_size: int) -> float:
    """kv_utilization over tables that may hold ``NULL_BLOCK_ID``: tokens held in live
    blocks / (distinct live blocks x block_size)."""
    return kv_utilization(tables, block_size, skip_id=NULL_BLOCK_ID)


class WindowedKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` that frees blocks falling out of each request's window."""

    prefix_caching_conflict = (
        "windowed KV eviction frees blocks out of the window, and a freed block cannot be "
        "part of a cached full prefix"
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        kv_window: KVWindow,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
        max_chunk: int | None = None,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        if max_chunk is not None and (not isinstance(max_chunk, int) or max_chunk < 1):
            raise ValueError(f"max_chunk must be a positive int or None, got {max_chunk!r}")
        self.kv_window = kv_window
        self.max_chunk = max_chunk  # the most tokens one step schedules for a request
        self.num_window_freed_blocks = 0

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> WindowedKVCacheManager:
        """Build from ``config`` (its ``kv_window`` must be set)."""
        if config.kv_window is None:
            raise ValueError("a windowed KV cache manager needs KVCacheConfig.kv_window")
        return cls(
            config.num_blocks,
            config.block_size,
            kv_window=config.kv_window,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks,
            max_chunk=config.max_num_batched_tokens,
        )

    def max_live_blocks(self, num_tokens: int) -> int:
        """At most the sinks' blocks plus those a window and two steps' chunks span (with
        ``max_chunk`` known; else every block of ``num_tokens`` tokens, as unwindowed).

        NOTE: why two chunks. The scheduler frees a request's out-of-window blocks after the
        step's allocations (``remove_skipped_blocks``), by the tokens computed when it was
        scheduled, c'. At its next allocation it holds the sinks' blocks and those from the
        window's start at c' (position c' - W + 1) through the new chunk's end: the chunk
        computed since (<= max_chunk tokens), the new one (<= max_chunk) and W - 2 more,
        plus two blocks of alignment.
        """
        every = self.num_blocks_for(num_tokens)
        if self.max_chunk is None:
            return every
        w, bs = self.kv_window, self.block_size
        span = (2 * self.max_chunk + w.window - 2) // bs + 2
        return min(every, -(-w.num_sink_tokens // bs) + span)

    def _skipped_blocks(self, request: Request) -> range:
        """The request's blocks out of its window (sinks and the last ``window`` stay)."""
        w = self.kv_window
        return out_of_window_blocks(
            request.num_computed_tokens, w.num_sink_tokens, w.window, self.block_size
        )

    def remove_skipped_blocks(self, request: Request) -> list[int]:
        """As the base method; also counts the freed blocks (``window_freed_blocks``)."""
        freed = super().remove_skipped_blocks(request)
        self.num_window_freed_blocks += len(freed)
        return freed

    def free_out_of_window(self, request: Request) -> list[int]:
        """Free the request's blocks that left its window; returns their ids.

        The windowed name of ``remove_skipped_blocks`` (the scheduler calls that one).
        """
        return self.remove_skipped_blocks(request)

    def snapshot(self) -> dict[str, float | int]:
        """The base figures (utilization over live blocks) plus the freed-block count."""
        d = super().snapshot()
        d["window_freed_blocks"] = self.num_window_freed_blocks
        return d
