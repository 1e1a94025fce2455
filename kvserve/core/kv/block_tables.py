"""Per-request block tables over a ``BlockPool``: the lower layer of ``KVCacheManager``.

``BlockTableManager`` owns the pool, the tables (``core/tables.py``) and the pending
copy-on-write copies. It knows nothing of prefix caching, the host tiers or swapping
(``KVCacheManager``, the layer above, adds those), so its job is the one every allocator
variant shares: hold blocks per request, share them (``fork``), replace the ones a write
must not touch (``_copy_on_write``), free the ones no query reads (``remove_skipped_blocks``)
and release them (``free``).

Hooks a variant overrides (vLLM's single_type_kv_cache_manager style): ``_new_block_pool``
(the pool), ``_skipped_blocks`` (which blocks no later query reads; none for full
attention), ``max_live_blocks`` (the most blocks a request holds at once; all of its tokens'
for full attention) and ``_check_table_policy`` (extra per-table invariants). Helpers the layers
above use instead of this class's state: ``_table``, ``_new_table``, ``_pop_table``,
``_all_tables``, ``_queue_copies``, ``_num_copy_pins``, ``_copies_into``, ``_release``.

Skipped entries: a freed entry holds the pool's null block (``NULL_BLOCK_ID``, outside the id
space), so every other position keeps its slot; ``free`` and ``fork`` skip it, utilization
does not count it, and integrity allows it only where ``_skipped_blocks`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, ValuesView

from kvserve.core.kv import integrity
from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.metrics import KVCacheCounters, kv_utilization, ratio
from kvserve.core.kv.prefix_cache import PrefixCache
from kvserve.core.kv.tables import BlockTable
from kvserve.request import Request


def check_count(name: str, value: object) -> None:
    """ValueError unless ``value`` is a non-negative int (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def check_allocate_args(
    request_id: str,
    swapped: Container[str],
    num_new_tokens: int,
    num_new_computed_tokens: int,
    reserve: int,
) -> None:
    """ValueError for an ``allocate_slots`` call no manager takes: a negative count, or a
    request that is swapped out (it must be swapped in first)."""
    if num_new_tokens < 0 or num_new_computed_tokens < 0 or reserve < 0:
        raise ValueError(
            f"allocate_slots: num_new_tokens={num_new_tokens}, num_new_computed_tokens="
            f"{num_new_computed_tokens} and reserve={reserve} must all be >= 0"
        )
    if request_id in swapped:
        raise ValueError(
            f"request {request_id!r} is swapped out: swap_in() before allocate_slots()"
        )


class BlockTableManager:
    """Block tables, copy-on-write, fork, skipped blocks and free. See the module docstring."""

    def __init__(
        self, num_blocks: int, block_size: int, *, on_evict: Callable[[KVBlock], None]
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.counters = KVCacheCounters()
        self._pool = self._new_block_pool(num_blocks, on_evict)
        self._null = self._pool.null_block
        self._tables: dict[str, BlockTable] = {}
        # Copy-on-write (src, dst); src keeps the reference its table dropped until
        # take_pending_copies(), so nothing can overwrite it before the runner copies it.
        self._pending_copies: list[tuple[KVBlock, KVBlock]] = []

    # ------------------------------------------------------------------ capacity

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable right now: free plus cached-but-evictable."""
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """kv_usage: blocks referenced by live requests / total blocks."""
        return ratio(self.num_blocks - self._pool.num_free_blocks, self.num_blocks)

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    def max_live_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once (hook): here all
        of them; the windowed manager frees blocks as they leave the window. Admission
        rejects a request whose bound exceeds the pool, and a request without max_tokens stops
        where its next token's would."""
        return self.num_blocks_for(num_tokens)

    def has_room_for(self, request: Request, reserve: int = 0) -> bool:
        """Whether ``request``'s known tokens (and ``reserve`` blocks more) fit the free blocks
        now: the priority policy's test of a waiting request (hook: the contiguous manager
        asks for one free run of its whole reservation)."""
        return self.num_free_blocks >= self.max_live_blocks(request.num_tokens) + reserve

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's device block table (a new list; empty if it has none).

        Skipped entries read ``NULL_BLOCK_ID`` (-1), the pool's null block.
        """
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table is not None else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every KV cache group's table: None, one group here (``core/kv/hybrid.py``)."""
        return None

    # ------------------------------------------------------------------ hooks for variants

    def _new_block_pool(self, num_blocks: int, on_evict: Callable[[KVBlock], None]) -> BlockPool:
        """The pool of physical blocks (hook). Its null block marks skipped table entries."""
        return BlockPool(num_blocks, external_null_block=True, on_evict=on_evict)

    def _skipped_blocks(self, request: Request) -> range:
        """Indices of the request's blocks no later query reads (hook): none here."""
        return range(0)

    def _check_table_policy(self, table: BlockTable) -> None:
        """Invariants a variant adds for each table (hook): none here."""

    # ------------------------------------------------------------------ helpers for layers above

    def _table(self, request_id: str) -> BlockTable | None:
        """The request's device block table, or None."""
        return self._tables.get(request_id)

    def _new_table(
        self, request: Request, blocks: list[KVBlock], num_cached: int = 0
    ) -> BlockTable:
        """Record a fresh device block table for ``request`` (it must have none)."""
        table = BlockTable(request, blocks, num_cached, num_cached)
        self._tables[request.request_id] = table
        return table

    def _pop_table(self, request_id: str) -> BlockTable | None:
        """Forget the request's table (its blocks are not released) and return it."""
        return self._tables.pop(request_id, None)

    def _all_tables(self) -> ValuesView[BlockTable]:
        """Every live device block table."""
        return self._tables.values()

    def _queue_copies(self, pairs: Iterable[tuple[KVBlock, KVBlock]]) -> None:
        """Queue copy-on-write (src, dst) copies; each src keeps a reference until taken."""
        before = len(self._pending_copies)
        self._pending_copies.extend(pairs)
        self.counters.cow_copies += len(self._pending_copies) - before

    def _num_copy_pins(self, block: KVBlock) -> int:
        """References ``block`` holds as a pending copy source."""
        return sum(1 for src, _ in self._pending_copies if src is block)

    def _copies_into(self, blocks: list[KVBlock]) -> bool:
        """True if a copy queued in this step writes one of ``blocks``."""
        return any(dst in blocks for _, dst in self._pending_copies)

    def _release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order; null entries hold none."""
        null = self._null
        self._pool.free(b for b in blocks if b is not null)

    def _copy_on_write(
        self, table: BlockTable, indices: list[int], fresh: list[KVBlock], num_computed: int
    ) -> None:
        """Replace the blocks at ``indices`` (ascending) by ``fresh`` ones.

        A replaced block that holds computed tokens (only the first, when the write starts
        mid-block) is copied: (old, new) is queued and old keeps this table's reference as
        a pin. The others are overwritten in full, so they are just released, tail first.
        """
        released = []
        for i, new in zip(reversed(indices), fresh, strict=True):
            old = table.blocks[i]
            table.blocks[i] = new
            if i * self.block_size < num_computed:
                self._queue_copies([(old, new)])
            else:
                released.append(old)
        self._pool.free(released)
        # The table's cached run now ends before the first replaced block.
        table.num_cached_blocks = min(table.num_cached_blocks, indices[0])
        table.num_full_checked = min(table.num_full_checked, indices[0])

    # ------------------------------------------------------------------ per-step operations

    def remove_skipped_blocks(self, request: Request) -> list[int]:
        """Free the request's blocks that no later query reads; returns their ids.

        Their table entries become the pool's null block (``NULL_BLOCK_ID``), so every other
        position keeps its slot. Which blocks: ``_skipped_blocks`` (none for full attention,
        so this is a no-op here). Call after the step's last allocation, before the runner
        executes the step: the freed blocks are only read masked in this step and nobody
        can allocate them before the next step.
        """
        skipped = self._skipped_blocks(request)
        table = self._tables.get(request.request_id) if skipped else None
        if table is None:
            return []
        blocks, null = table.blocks, self._null
        freed = []
        for i in skipped:
            if i >= len(blocks):
                break
            if blocks[i] is not null:
                freed.append(blocks[i])
                blocks[i] = null  # type: ignore[assignment]
        self._pool.free(freed)
        return [b.block_id for b in freed]

    def set_lookahead(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding: the table's slots past the request's known tokens (its
        ``num_tokens`` + async placeholders) hold ``num_tokens`` draft tokens this step.

        Call right after the ``allocate_slots`` that covered them (all or nothing with the
        step's other slots). Draft tokens are not the request's tokens, so the prefix cache
        (which hashes a request's own tokens, full blocks only) never takes their blocks.
        """
        check_count("num_tokens", num_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            raise ValueError(f"set_lookahead: request {request.request_id!r} has no table")
        table.num_lookahead = num_tokens

    def release_rejected(self, request: Request, num_verified_tokens: int) -> list[int]:
        """After verification: the request's KV is valid for its first ``num_verified_tokens``
        positions; free the blocks past those that cover them (blocks that held only rejected
        draft tokens), tail first. The lookahead ends. Returns the freed block ids.

        A kept block's rejected slots are written again by later steps before any read.
        """
        check_count("num_verified_tokens", num_verified_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            return []
        table.num_lookahead = 0
        keep = -(-num_verified_tokens // self.block_size)
        tail = table.blocks[keep:]
        if not tail:
            return []
        del table.blocks[keep:]
        self._release(reversed(tail))
        return [b.block_id for b in tail]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) device block pairs queued since the last call; clears.

        Releases the pins on the sources: call once per step, after the last allocation.
        """
        if not self._pending_copies:
            return []
        pending, self._pending_copies = self._pending_copies, []
        self._pool.free(src for src, _ in pending)
        return [(src.block_id, dst.block_id) for src, dst in pending]

    def free(self, request: Request) -> None:
        """Drop the request's device blocks, tail first. No-op for unknown requests.

        Cached blocks stay matchable (evictable, the tail before the head), uncached ones
        are reused first.
        """
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self._release(reversed(table.blocks))

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole block table, every block's ref count +1.

        The child's tokens must agree with the parent's over the positions the parent has
        computed (the shared K/V). Its first write into a shared block copies it. Skipped
        (null) entries are shared as they are.
        """
        pid, cid = parent.request_id, child.request_id
        ptable = self._tables.get(pid)
        if ptable is None:
            raise ValueError(f"fork: parent {pid!r} has no device block table")
        if cid == pid or cid in self._tables:
            raise ValueError(f"fork: child {cid!r} already has blocks")
        num_shared = min(child.num_tokens, parent.num_computed_tokens)
        if child.token_ids_slice(0, num_shared) != parent.token_ids_slice(0, num_shared):
            raise ValueError(
                f"fork: child {cid!r}'s tokens differ from parent {pid!r}'s computed tokens"
            )
        live = [b for b in ptable.blocks if b is not self._null]
        self._pool.touch(live)
        num_cached = min(ptable.num_cached_blocks, num_shared // self.block_size)
        self._new_table(child, list(ptable.blocks), num_cached)
        self.counters.fork_shared_blocks += len(live)

    # ------------------------------------------------------------------ figures and checks

    def _utilization(self) -> float:
        """kv_utilization over live blocks (skipped null entries hold no tokens)."""
        return kv_utilization(
            (
                ([b.block_id for b in t.blocks], t.request.num_computed_tokens)
                for t in self._tables.values()
            ),
            self.block_size,
            skip_id=self._null.block_id if self._null is not None else None,
        )

    def _dump_tables(self) -> dict[str, object]:
        """The tables, the pool and the pending copies as plain comparable data."""
        return {
            "tables": {
                rid: ([b.block_id for b in t.blocks], t.num_cached_blocks, t.num_full_checked)
                for rid, t in self._tables.items()
            },
            "free_block_ids": self._pool.free_block_ids(),
            "ref_cnts": [b.ref_cnt for b in self._pool.blocks],
            "cached": [b.cache_node is not None for b in self._pool.blocks],
            "pending_copies": [(s.block_id, d.block_id) for s, d in self._pending_copies],
        }

    def _check_tables(self, cache: PrefixCache) -> None:
        """Pool, ref counts and every table's invariants (raises ``IntegrityError``)."""
        pool = self._pool
        pool.check_integrity()
        tables = self._tables.values()
        integrity.check_ref_counts(tables, pool, (src for src, _ in self._pending_copies))
        for table in tables:
            skippable = self._skipped_blocks(table.request)
            integrity.check_table(table, cache, self.block_size, self._null, skippable)
            integrity.check_lookahead(table, self.block_size)
            self._check_table_policy(table)
