"""Contiguous per-request reservation: the naive KV allocator, kept as a real mode to compare.

The allocator the seeds call naive (../shared/seeds/): on a request's first allocation it
reserves, as **one run of consecutive block ids**, every block the request could ever need,
and never grows. The run is freed whole when the request ends (or is preempted).

- Reservation: ``ceil(max_len / block_size)`` blocks, with
  ``max_len = min(prompt + max_tokens, max_model_len)`` (``max_model_len`` when max_tokens is
  None), capped at the pool: the scheduler finishes a request before its KV could outgrow the
  pool, so a longer run could never be used. *Choice*: ``max_tokens`` is what the client
  asked for, the longest the request may become; a client that asks for more than it uses
  wastes the difference (internal fragmentation).
- Placement: first fit (the lowest-id free run long enough). A run must be consecutive ids:
  when no free run is long enough the allocation fails, even when enough blocks are free in
  total (external fragmentation; counted in ``fragmented_alloc_failures``).
- No sharing: prefix caching is off (``get_computed_blocks`` finds nothing) and an n > 1
  child gets its own run at its first write (its computed blocks are copied, as
  copy-on-write does in the paged mode); until then it only refers to its parent's run.
- Swap preemption moves only the blocks holding computed tokens; ``swap_in`` reserves a
  fresh run (anywhere) and copies them back.
- ``reserve`` (admission headroom plus the blocks the rest of the prompt will need, from the
  scheduler): the allocation needs a free run and ``num_free_blocks >= needed + reserve``,
  ``needed`` being the blocks the step's tokens fill, as in the paged mode. The run's other
  blocks are the request's own growth, which is what the reserve stands for.

The runtime is unchanged: it still reads K/V through the block table (which here lists
consecutive ids), so the mode changes how many requests fit, not how attention addresses
memory. ``kv_utilization`` is tokens stored / tokens reserved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.kv_cache_config import KVCacheConfig
from kvserve.core.kv.kv_cache_manager import KVCacheManager
from kvserve.core.kv.metrics import ratio
from kvserve.core.kv.tables import BlockTable
from kvserve.request import Request

_FREE = 1
_HELD = 0


class RunBlockPool(BlockPool):
    """A ``BlockPool`` that also keeps a byte per block (1 = free) to find free runs fast.

    NOTE: ``bytearray.find`` scans at C speed, so first fit is O(num_blocks) bytes per
    allocation attempt without a Python loop; every ref-count change goes through the three
    methods below, which keep the map in step.
    """

    def __init__(self, num_blocks: int, **kwargs: object) -> None:
        super().__init__(num_blocks, **kwargs)  # type: ignore[arg-type]
        self.free_map = bytearray([_FREE]) * num_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        out = super().allocate(num_blocks)
        for block in out:
            self.free_map[block.block_id] = _HELD
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        blocks = list(blocks)
        super().touch(blocks)
        for block in blocks:
            self.free_map[block.block_id] = _HELD

    def free(self, blocks: Iterable[KVBlock]) -> None:
        blocks = list(blocks)
        super().free(blocks)
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_map[block.block_id] = _FREE

    def find_run(self, num_blocks: int) -> int | None:
        """First id of the lowest free run of ``num_blocks`` consecutive blocks, or None."""
        if num_blocks == 0:
            return 0
        start = self.free_map.find(bytes([_FREE]) * num_blocks)
        return None if start < 0 else start

    def largest_free_run(self) -> int:
        """Length of the longest run of consecutive free blocks."""
        return max(map(len, self.free_map.split(bytes([_HELD]))), default=0)

    def check_integrity(self) -> None:
        super().check_integrity()
        for block in self.blocks:
            want = _FREE if block.ref_cnt == 0 else _HELD
            if self.free_map[block.block_id] != want:
                raise IntegrityError(
                    f"free map: block {block.block_id} marked {self.free_map[block.block_id]} "
                    f"with ref {block.ref_cnt}"
                )


class ContiguousKVCacheManager(KVCacheManager):
    """Per-request contiguous reservation for the maximum length. See the module docstring.

    Hooks: ``_new_block_pool`` (a ``RunBlockPool``), ``_allocate_slots`` (one run per
    request, unshared on a fork's first write), ``_swap_out_blocks`` (the computed blocks
    only), ``_blocks_for_swap_in`` (a fresh run) and ``_check_table_policy`` (one run of its
    reservation).
    """

    prefix_caching_conflict = "the contiguous allocator's per-request reservation shares no blocks"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool):
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.num_fragmented_failures = 0
        super().__init__(
            num_blocks,
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> ContiguousKVCacheManager:
        """Build from ``config`` (its ``max_model_len`` must be set)."""
        if config.max_model_len is None:
            raise ValueError("the contiguous KV allocator needs KVCacheConfig.max_model_len")
        return cls(
            config.num_blocks,
            config.block_size,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=config.num_host_blocks,
        )

    def _new_block_pool(self, num_blocks: int, on_evict: Callable[[KVBlock], None]) -> BlockPool:
        self._runs = RunBlockPool(num_blocks, external_null_block=True, on_evict=on_evict)
        return self._runs

    # ------------------------------------------------------------------ reservation

    def num_reserved_blocks(self, request: Request) -> int:
        """Blocks reserved for ``request``: its maximum length in blocks, at most the pool."""
        max_tokens = request.max_tokens
        max_len = self.max_model_len
        if max_tokens is not None:
            max_len = min(request.num_prompt_tokens + max_tokens, max_len)
        return min(self.num_blocks_for(max_len), self.num_blocks)

    @property
    def largest_free_run(self) -> int:
        """The longest run of consecutive free blocks: the largest reservation possible now."""
        return self._runs.largest_free_run()

    def has_room_for(self, request: Request, reserve: int = 0) -> bool:
        """One free run for the whole reservation (and ``reserve`` blocks more free)."""
        need = self.num_reserved_blocks(request)
        return self.largest_free_run >= need and self.num_free_blocks >= need + reserve

    def _take_run(self, num_run: int, num_needed: int, reserve: int) -> list[KVBlock] | None:
        """Hold the first free run of ``num_run`` blocks, or None (nothing changed).

        Needs the run and ``num_free_blocks >= num_needed + reserve`` (module docstring).
        """
        pool = self._runs
        if num_run > pool.num_free_blocks or num_needed + reserve > pool.num_free_blocks:
            return None
        start = pool.find_run(num_run)
        if start is None:
            self.num_fragmented_failures += 1  # enough blocks in total, none contiguous
            return None
        run = pool.blocks[start : start + num_run]
        pool.touch(run)
        return run

    # ------------------------------------------------------------------ allocation

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_ids: list[int],
        num_new_computed_tokens: int,
        reserve: int,
    ) -> list[int] | None:
        """The allocation policy: the whole reservation at the first call, nothing later.

        The request's tokens, left to right::

            |  computed  |     new      |   reserved, not yet written   |
            |<------------------ one run of consecutive block ids ------------------>|
            0            ^ num_computed_tokens      ^ num_total     num_reserved_blocks

        No prefix hits (none are ever found). A forked child's first write takes a run of
        its own (``_unshare``).
        """
        rid = request.request_id
        if computed_ids or num_new_computed_tokens:
            raise ValueError(
                f"allocate_slots: request {rid!r} got prefix hits, but the contiguous "
                "allocator shares no blocks (get_computed_blocks finds none)"
            )
        num_total = request.num_computed_tokens + num_new_tokens
        num_needed = self.num_blocks_for(num_total)
        num_run = self.num_reserved_blocks(request)
        if num_needed > num_run:
            raise ValueError(
                f"allocate_slots: request {rid!r} needs {num_needed} blocks for {num_total} "
                f"tokens, past its reservation of {num_run} (prompt + max_tokens, at most "
                f"max_model_len={self.max_model_len} and the pool)"
            )
        table = self._table(rid)
        if table is None:
            run = self._take_run(num_run, num_needed, reserve)
            if run is None:
                return None
            self._new_table(request, run)
            return [b.block_id for b in run]
        if num_new_tokens and self._is_shared(table):
            return self._unshare(table, num_needed, reserve)
        return []

    def _is_shared(self, table: BlockTable) -> bool:
        """True while another table holds the run (a fork not yet written to).

        NOTE: copy-on-write pins do not count: the runner executes the step's copies before
        its forward pass, so the last holder may write into blocks copied from in this step.
        """
        # NOTE: fork shares a whole run and unsharing replaces a whole table, so every block
        # of a run has the same holders: the first block tells.
        first = table.blocks[0]
        return first.ref_cnt - self._num_copy_pins(first) != 1

    def _unshare(self, table: BlockTable, num_needed: int, reserve: int) -> list[int] | None:
        """A forked child's first write: its own run, computed blocks copied from the parent's.

        The copy sources keep this table's reference (a pin) until ``take_pending_copies``.
        """
        request = table.request
        run = self._take_run(len(table.blocks), num_needed, reserve)
        if run is None:
            return None
        old = table.blocks
        num_copied = self.num_blocks_for(request.num_computed_tokens)
        self._queue_copies(zip(old[:num_copied], run[:num_copied], strict=True))
        self._release(reversed(old[num_copied:]))
        table.blocks = run
        return [b.block_id for b in run]

    # ------------------------------------------------------------------ swap

    def _swap_out_blocks(self, table: BlockTable) -> list[KVBlock]:
        """Only the blocks holding computed tokens move; the whole run is freed."""
        num_used = self.num_blocks_for(table.request.num_computed_tokens)
        return table.blocks[: min(num_used, len(table.blocks))]

    def _blocks_for_swap_in(
        self, request: Request, num_host_blocks: int, reserve: int
    ) -> tuple[list[KVBlock], int] | None:
        """A fresh run of the whole reservation (anywhere); nothing is reused."""
        run = self._take_run(self.num_reserved_blocks(request), num_host_blocks, reserve)
        return None if run is None else (run, 0)

    # ------------------------------------------------------------------ figures

    def snapshot(self) -> dict[str, float | int]:
        """The base figures plus the free-run figures of contiguous allocation.

        ``largest_free_run_blocks``: the biggest reservation possible now;
        ``external_fragmentation``: 1 - largest free run / free blocks (0 when none is free);
        ``fragmented_alloc_failures``: allocation attempts that failed for want of a run
        although enough blocks were free in total (the scheduler retries its queue head
        every step, so one waiting request can count many times).
        """
        d = super().snapshot()
        largest = self.largest_free_run
        num_free = self.num_free_blocks
        d["largest_free_run_blocks"] = largest
        d["external_fragmentation"] = 1.0 - ratio(largest, num_free) if num_free else 0.0
        d["fragmented_alloc_failures"] = self.num_fragmented_failures
        return d

    def _check_table_policy(self, table: BlockTable) -> None:
        """Every table is one run of consecutive ids of its reservation, uncached."""
        rid = table.request.request_id
        ids = [b.block_id for b in table.blocks]
        want = self.num_reserved_blocks(table.request)
        if len(ids) != want:
            raise IntegrityError(f"request {rid!r}: holds {len(ids)} blocks, reserved {want}")
        if ids and ids != list(range(ids[0], ids[0] + len(ids))):
            raise IntegrityError(f"request {rid!r}: its blocks {ids} are not one consecutive run")
        if table.num_cached_blocks != 0:
            raise IntegrityError(f"request {rid!r}: contiguous blocks cached")
