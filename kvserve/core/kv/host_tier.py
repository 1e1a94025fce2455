"""Host-memory tier: host block ids shared by swap preemption and the prefix-cache offload tier.

Host blocks are a separate id space ``[0, num_blocks)`` (the runtime's CPU tensor). Each one
is in exactly one of four states:

- **free**: in the free stack (lowest id handed out first, so plans are deterministic).
- **held**: owned by the manager outside the tier's lists: a swapped-out request's table,
  or (briefly, inside one ``allocate_slots`` call) a prefix block being loaded back.
- **cached**: holds an offloaded prefix-cache block (``cache_node`` is set; the prefix tree
  maps a run of tokens to it). Kept in an LRU list, oldest first, and evictable.
- **deferred**: released in this step while step-pinned (see below); free at ``end_step``.

Step pins (only with ``step_pins=True``, i.e. when the prefix offload tier is on): a host
block written (swap-out / offload destination) or read (swap-in / load source) by this
step's plans must not be handed out again before the runner has executed the step, or a
second plan would target it (the runner does every swap-out before any swap-in). So a
pinned block is never allocated or evicted, and one released while pinned becomes free only
at ``end_step()`` (called when the manager hands the step's plans over). Without the offload
tier the scheduler never mixes swap-ins and swap-outs in one step, so no pins are needed
and released blocks are free at once.

LRU order is offload order. A block is offloaded only after all its cached descendants left
the device, and a host block never gains a child, so a cached host block's children sit
before it in the list: the front-most unpinned cached block is a leaf of the prefix tree.
Blocks offloaded in this step (pinned) sit behind every unpinned one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvserve.core.errors import IntegrityError


@dataclass(slots=True, eq=False)
class HostBlock:
    """One host-tier block. Identity matters (``eq=False``): compare with ``is``."""

    host_block_id: int
    # Owned by the prefix cache (its tree node) while this block holds an offloaded prefix
    # block; None otherwise.
    cache_node: object | None = None

    @property
    def is_cached(self) -> bool:
        """True while the prefix cache maps a run of tokens to this host block."""
        return self.cache_node is not None

    def __repr__(self) -> str:
        cached = ", cached" if self.cache_node is not None else ""
        return f"HostBlock({self.host_block_id}{cached})"


class HostTier:
    """Free stack, LRU of offloaded prefix blocks and step pins of the host tier.

    ``on_evict(block)`` is called when a cached host block is handed out again; the manager
    uses it to drop the block from the prefix cache (it is a leaf there).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        step_pins: bool,
        on_evict: Callable[[HostBlock], None] | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        self.step_pins = step_pins
        self.on_evict = on_evict
        # NOTE: a stack, so the lowest ids come out first (deterministic plans).
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru: dict[int, HostBlock] = {}  # cached blocks by id, oldest first
        self.pinned_ids: set[int] = set()
        self.deferred_ids: list[int] = []
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus unpinned cached (evictable)."""
        num_pinned_cached = sum(1 for i in self.pinned_ids if i in self.lru)
        return len(self.free_ids) + len(self.lru) - num_pinned_cached

    @property
    def num_cached_blocks(self) -> int:
        """Host blocks holding offloaded prefix-cache blocks."""
        return len(self.lru)

    def allocate(self, num_blocks: int) -> list[HostBlock]:
        """Hand out ``num_blocks`` held blocks: free ones first, then evict LRU cached ones.

        Pins them for the step when step pins are on. Raises ValueError if fewer than
        ``num_blocks`` can be had (callers check ``num_free_blocks``).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} host blocks: only {self.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            if self.free_ids:
                block = self.blocks[self.free_ids.pop()]
            else:
                block = self._evict_one()
            if self.step_pins:
                self.pinned_ids.add(block.host_block_id)
            out.append(block)
        return out

    def _evict_one(self) -> HostBlock:
        # NOTE: pinned cached blocks were offloaded in this step, so they are at the back;
        # the first unpinned one is the oldest offload, a leaf of the prefix tree.
        for block in self.lru.values():
            if block.host_block_id not in self.pinned_ids:
                break
        else:
            raise IntegrityError("host tier: no evictable block although one was counted")
        del self.lru[block.host_block_id]
        self.num_evictions += 1
        if self.on_evict is None:
            raise IntegrityError(f"cached host block {block.host_block_id} but no on_evict hook")
        self.on_evict(block)
        return block

    def add_cached(self, block: HostBlock) -> None:
        """A held block now holds an offloaded prefix block: newest in the LRU."""
        if block.host_block_id in self.lru:
            raise ValueError(f"host block {block.host_block_id} is already cached")
        self.lru[block.host_block_id] = block

    def take_cached(self, blocks: Iterable[HostBlock]) -> None:
        """Cached blocks about to be loaded back: out of the LRU (held), pinned for the step."""
        for block in blocks:
            if self.lru.pop(block.host_block_id, None) is None:
                raise ValueError(f"host block {block.host_block_id} is not in the host LRU")
            if self.step_pins:
                self.pinned_ids.add(block.host_block_id)

    def uncache(self, block: HostBlock) -> None:
        """A cached block the prefix cache dropped: out of the LRU (held)."""
        if self.lru.pop(block.host_block_id, None) is None:
            raise ValueError(f"host block {block.host_block_id} is not in the host LRU")

    def pin(self, blocks: Iterable[HostBlock]) -> None:
        """Pin blocks read or written by this step's plans (no-op without step pins)."""
        if self.step_pins:
            self.pinned_ids.update(b.host_block_id for b in blocks)

    def release(self, blocks: Iterable[HostBlock]) -> None:
        """Held blocks back to free (deferred to ``end_step`` while pinned), in this order."""
        for block in blocks:
            if block.cache_node is not None:
                raise ValueError(f"host block {block.host_block_id} is still cached")
            if block.host_block_id in self.pinned_ids:
                self.deferred_ids.append(block.host_block_id)
            else:
                self.free_ids.append(block.host_block_id)

    def end_step(self) -> None:
        """The step's plans were handed to the runner: drop the pins, free deferred blocks."""
        if self.deferred_ids:
            self.free_ids.extend(reversed(self.deferred_ids))
            self.deferred_ids = []
        self.pinned_ids.clear()

    def check_integrity(self, held_ids: Iterable[int]) -> None:
        """Raise IntegrityError if the states do not partition the host ids.

        ``held_ids``: the ids the manager holds (swapped-out requests' tables).
        """
        held = list(held_ids)
        everything = sorted([*self.free_ids, *self.deferred_ids, *self.lru, *held])
        if everything != list(range(self.num_blocks)):
            raise IntegrityError(
                "host tier: blocks are leaked or double-booked (free/deferred/cached/held)"
            )
        for i, block in self.lru.items():
            if block is not self.blocks[i] or block.cache_node is None:
                raise IntegrityError(f"host tier: LRU block {i} is not cached")
        for i in [*self.free_ids, *self.deferred_ids, *held]:
            if self.blocks[i].cache_node is not None:
                raise IntegrityError(f"host tier: uncached block {i} is cached")
        if not set(self.deferred_ids) <= self.pinned_ids:
            raise IntegrityError("host tier: deferred block not pinned")
        if not self.step_pins and self.pinned_ids:
            raise IntegrityError("host tier: pins without step pins")
        seen_pinned = False
        for i in self.lru:
            if i in self.pinned_ids:
                seen_pinned = True
            elif seen_pinned:
                raise IntegrityError(f"host tier: unpinned block {i} behind a pinned one")
