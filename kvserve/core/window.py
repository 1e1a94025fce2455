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

``WindowedKVCacheManager`` is a ``KVCacheManager`` whose tables may hold the
``NULL_KV_BLOCK`` placeholder. Its rules:

- Prefix caching is off: a freed block cannot be part of a cached full prefix.
- ``swap_out`` of a table with freed blocks returns None (as if the host tier were full), so
  the scheduler preempts such a request by recompute.
- ``free``, ``fork``, ``snapshot`` and ``check_integrity`` skip the placeholders.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvserve.core.block_pool import KVBlock
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.metrics import ratio
from kvserve.request import Request

NULL_BLOCK_ID = -1
# NOTE: never part of the pool; it only marks a freed table entry. Identity matters.
NULL_KV_BLOCK = KVBlock(NULL_BLOCK_ID)


@dataclass(frozen=True, slots=True)
class KVWindow:
    """The window of a windowed engine: the last ``window`` tokens plus the first sinks."""

    window: int
    num_sink_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"kv_window must be a positive int, got {self.window!r}")
        if not isinstance(self.num_sink_tokens, int) or self.num_sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens must be an int >= 0, got {self.num_sink_tokens!r}")


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
    filled: dict[int, int] = {}
    for block_ids, num_computed in tables:
        for i, block_id in enumerate(block_ids):
            if block_id == NULL_BLOCK_ID:
                continue
            used = min(block_size, max(0, num_computed - i * block_size))
            filled[block_id] = max(filled.get(block_id, 0), used)
    return ratio(sum(filled.values()), len(filled) * block_size)


class WindowedKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` that frees blocks falling out of each request's window."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        kv_window: KVWindow,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        if enable_prefix_caching:
            raise ValueError(
                "windowed KV eviction needs enable_prefix_caching=False: a block freed out "
                "of the window cannot be part of a cached full prefix"
            )
        super().__init__(
            num_blocks, block_size, enable_prefix_caching=False, num_host_blocks=num_host_blocks
        )
        self.kv_window = kv_window
        self.num_window_freed_blocks = 0

    def free_out_of_window(self, request: Request) -> list[int]:
        """Free the request's blocks that left its window; returns their ids.

        Call after the step's allocations, before the runner executes the step: the freed
        blocks are only read masked in this step and nobody can allocate them before the
        next step. Their table entries become ``NULL_BLOCK_ID``.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            return []
        w = self.kv_window
        dead = out_of_window_blocks(
            request.num_computed_tokens, w.num_sink_tokens, w.window, self.block_size
        )
        blocks = table.blocks
        freed = []
        for i in dead:
            if i >= len(blocks):
                break
            if blocks[i] is not NULL_KV_BLOCK:
                freed.append(blocks[i])
                blocks[i] = NULL_KV_BLOCK
        if freed:
            self._pool.free(freed)
            self.num_window_freed_blocks += len(freed)
        return [b.block_id for b in freed]

    @contextmanager
    def _without_placeholders(self) -> Iterator[None]:
        """Take the placeholders out of every table for the body; put them back after."""
        saved = {}
        for rid, table in self._tables.items():
            holes = [i for i, b in enumerate(table.blocks) if b is NULL_KV_BLOCK]
            if holes:
                saved[rid] = holes
                table.blocks = [b for b in table.blocks if b is not NULL_KV_BLOCK]
        try:
            yield
        finally:
            for rid, holes in saved.items():
                table = self._tables.get(rid)
                if table is not None:
                    for i in holes:
                        table.blocks.insert(i, NULL_KV_BLOCK)

    def free(self, request: Request) -> None:
        """As ``KVCacheManager.free``; freed-out-of-window entries hold nothing to release."""
        table = self._tables.get(request.request_id)
        if table is not None:
            table.blocks = [b for b in table.blocks if b is not NULL_KV_BLOCK]
        super().free(request)

    def fork(self, parent: Request, child: Request) -> None:
        """As ``KVCacheManager.fork``; the child shares the parent's freed entries too."""
        ptable = self._tables.get(parent.request_id)
        holes = [i for i, b in enumerate(ptable.blocks) if b is NULL_KV_BLOCK] if ptable else []
        with self._without_placeholders():
            super().fork(parent, child)
        ctable = self._tables[child.request_id]
        for i in holes:
            ctable.blocks.insert(i, NULL_KV_BLOCK)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """None (preempt by recompute instead) once the request has freed blocks."""
        table = self._tables.get(request.request_id)
        if table is not None and any(b is NULL_KV_BLOCK for b in table.blocks):
            return None
        return super().swap_out(request)

    def snapshot(self) -> dict[str, float | int]:
        """The base figures with utilization over live blocks and the freed-block count."""
        with self._without_placeholders():
            d = super().snapshot()
        util = kv_utilization_windowed(
            (
                ([b.block_id for b in t.blocks], t.request.num_computed_tokens)
                for t in self._tables.values()
            ),
            self.block_size,
        )
        d["kv_utilization"] = util
        d["fragmentation"] = 1.0 - util if self._tables else 0.0
        d["window_freed_blocks"] = self.num_window_freed_blocks
        return d

    def check_integrity(self) -> None:
        """Base invariants, plus: placeholders only where the window allows, none cached."""
        w = self.kv_window
        for rid, table in self._tables.items():
            dead = out_of_window_blocks(
                table.request.num_computed_tokens, w.num_sink_tokens, w.window, self.block_size
            )
            for i, b in enumerate(table.blocks):
                assert b is not NULL_KV_BLOCK or i in dead, (
                    f"request {rid!r}: block {i} was freed but is still inside the window"
                )
        assert NULL_KV_BLOCK.ref_cnt == 0, "the placeholder was taken as a pool block"
        with self._without_placeholders():
            super().check_integrity()
