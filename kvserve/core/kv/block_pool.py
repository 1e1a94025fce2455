"""Physical KV blocks: ids, reference counts and an O(1) free list kept in eviction order.

The pool owns a fixed number of ``KVBlock`` records decided at start-up (the runtime owns
the bytes; the core owns the ids). A block is in exactly one of two states:

- **held**: ``ref_cnt > 0``. Referenced by block tables (and, briefly, by a pending
  copy-on-write source pin, see ``KVCacheManager``). Never in the free list.
- **free**: ``ref_cnt == 0``. In the free list. A free block may still be *cached*
  (``cache_node is not None``): its contents stay matchable by the prefix cache until the
  pool hands the block out again, which evicts it from the cache first.

The free list is the eviction order, a doubly linked list threaded through the blocks
themselves (intrusive ``prev_free`` / ``next_free``, like vLLM v1's FreeKVCacheBlockQueue),
so taking a block from the front, putting one at either end, and removing one from the
middle (a prefix hit revives a cached block) are all O(1) with no allocation:

- front: blocks that hold nothing reusable (never used, or freed while uncached). They are
  handed out first.
- back: cached blocks, least recently used first. ``free()`` takes the blocks in the order
  the caller wants them evicted; the manager passes a request's table tail-first, so its
  tail is evicted before its head (a radix tree can only drop leaves).

The null block (optional) stands for a table entry whose block was freed because no later
query reads it (``KVCacheManager.remove_skipped_blocks``, e.g. a block out of the KV window).
It is held forever (ref 1, never cached, never free) and tables may hold it any number of
times. Two layouts: ``reserve_null_block=True`` takes block 0 out of service (vLLM's layout:
the runtime reads a real block, masked); ``external_null_block=True`` makes it a block
outside the id space with id ``NULL_BLOCK_ID`` (-1), so no capacity is lost and the runtime
sees -1 (masked; a write into it is an error there). ``KVCacheManager`` uses the latter.

Invariants (``check_integrity``, raising ``IntegrityError``): the list is well linked and
holds exactly the blocks with ``ref_cnt == 0``; no uncached block follows a cached one; the
null block is never free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvserve.core.errors import IntegrityError

NULL_BLOCK_ID = -1  # the id of an external null block: a freed (skipped) table entry


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV block. Identity matters (``eq=False``): compare with ``is``."""

    block_id: int
    ref_cnt: int = 0
    # Owned by the prefix cache (its tree node); None while the block is not cached.
    cache_node: object | None = None
    # Intrusive free-list links; both None while the block is held.
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    @property
    def is_cached(self) -> bool:
        """True while the prefix cache maps a run of tokens to this block."""
        return self.cache_node is not None

    def __repr__(self) -> str:
        cached = ", cached" if self.cache_node is not None else ""
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinel before the first free block
        self._tail = KVBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Remove and return the first block (the next one to hand out)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from anywhere in the list."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the back: evicted last."""
        self._link_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the front: handed out first."""
        self._link_after(self._head, block)

    def _link_after(self, prev: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free list")
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block  # type: ignore[union-attr]
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free

    def check_integrity(self) -> None:
        """Raise IntegrityError if the links or the count are inconsistent."""
        count = 0
        prev = self._head
        block = self._head.next_free
        while block is not self._tail:
            if block is None:
                raise IntegrityError("free list: broken forward link")
            if block.prev_free is not prev:
                raise IntegrityError(f"free list: bad back link at block {block.block_id}")
            count += 1
            if count > self.num_free_blocks:
                raise IntegrityError("free list: longer than num_free_blocks (cycle?)")
            prev, block = block, block.next_free
        if self._tail.prev_free is not prev:
            raise IntegrityError("free list: tail sentinel's back link is stale")
        if count != self.num_free_blocks:
            raise IntegrityError(
                f"free list: {count} linked blocks but num_free_blocks={self.num_free_blocks}"
            )


class BlockPool:
    """A fixed set of physical blocks with reference counts and an eviction-ordered free list.

    ``on_evict(block)`` is called when a free *cached* block is handed out again, before it
    is reused; the prefix cache uses it to forget the block (it must be a leaf there).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        reserve_null_block: bool = False,
        external_null_block: bool = False,
        on_evict: Callable[[KVBlock], None] | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if reserve_null_block and num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 when a null block is reserved")
        if reserve_null_block and external_null_block:
            raise ValueError("reserve_null_block and external_null_block exclude each other")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # NOTE: the runtime needs no null block (padding slots are masked), so none is
        # reserved by default; block 0 is held forever when one is asked for.
        self.null_block: KVBlock | None = None
        self.num_reserved_blocks = int(reserve_null_block)
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1
        elif external_null_block:
            self.null_block = KVBlock(NULL_BLOCK_ID, ref_cnt=1)
        self._free = FreeBlockQueue(b for b in self.blocks if b.ref_cnt == 0)
        self.on_evict = on_evict
        self.num_evictions = 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can ever hold (all but the null block)."""
        return self.num_blocks - self.num_reserved_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-evictable ones included: what ``allocate`` can hand out."""
        return self._free.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the front of the free list, each with ref 1.

        A cached block taken this way is evicted from the prefix cache (``on_evict``) first.
        Raises ValueError if fewer blocks are free (callers check ``num_free_blocks``).
        """
        if num_blocks > self._free.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self._free.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.cache_node is not None:
                self.num_evictions += 1
                if self.on_evict is None:
                    raise IntegrityError(f"cached block {block.block_id} but no on_evict hook")
                self.on_evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block, taking free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order they should be evicted.

        A block reaching ref 0 goes to the back of the free list if cached (most recently
        used) and to the front if not (it holds nothing worth keeping).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            if block is self.null_block:
                raise ValueError("the null block is never freed")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.cache_node is not None:
                    self._free.append(block)
                else:
                    self._free.appendleft(block)

    def free_blocks(self) -> Iterator[KVBlock]:
        """The free blocks in eviction order (front first)."""
        return iter(self._free)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order (front first)."""
        return [b.block_id for b in self._free]

    def check_integrity(self) -> None:
        """Raise IntegrityError if the free list and the ref counts disagree."""
        self._free.check_integrity()
        seen_cached = False
        num_listed = 0
        for block in self._free:
            num_listed += 1
            if block.ref_cnt != 0:
                raise IntegrityError(f"block {block.block_id} is in the free list with ref>0")
            if block.cache_node is not None:
                seen_cached = True
            elif seen_cached:
                raise IntegrityError(
                    f"uncached block {block.block_id} follows a cached block in the free list"
                )
        num_zero = 0
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise IntegrityError(f"block {block.block_id} has ref {block.ref_cnt}")
            num_zero += block.ref_cnt == 0
        if num_zero != num_listed:
            raise IntegrityError(
                f"{num_zero} blocks have ref 0 but {num_listed} are in the free list"
            )
        null = self.null_block
        if null is not None:
            if null.ref_cnt != 1:
                raise IntegrityError("the null block must stay held (ref 1)")
            if null.cache_node is not None or null.prev_free is not None:
                raise IntegrityError("the null block must never be cached or free")
