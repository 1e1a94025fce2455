"""Prefix cache: a radix (Patricia) tree over full blocks of token ids (RadixAttention).

A path from a root spells a token sequence one *full* block at a time; each block-sized
step maps to the physical ``KVBlock`` that holds the K/V of those tokens given everything
before them. Edges are runs of blocks (a chain with no branching is one node), so a long
prompt costs one node, not one per block. There is one root per ``cache_salt``: requests
with different salts (e.g. tenants) can never share a block.

How the pieces cooperate (see ``KVCacheManager``):

- The tree takes no references. Holding a block is the block tables' business; a cached
  block whose ref count falls to 0 stays in the tree and sits at the back of the pool's
  free list (LRU). Eviction happens only when the pool hands such a block out again, and it
  removes exactly that block, which must then be the last block of a leaf edge.
- That is guaranteed by the manager's *ancestor closure*: whoever holds a cached block
  holds the whole path above it (a block table's cached part is a root path, and it only
  grows at its end). So a cached block's descendants are free whenever it is, were freed no
  later than it, and sit before it in the free list: the front-most cached block is a leaf.
- Only full blocks are cached, and a cached block is never written again (a write into one
  goes to a copy: copy-on-write in the manager).

Host offload tier (``KVCacheManager(enable_host_prefix_cache=True)``): a cached block can
also be a ``HostBlock``. When the pool evicts a cached device block the manager either
``replace``s it in the tree by a host block holding a copy of its K/V, or drops it with its
whole subtree (``remove_subtree``); a later hit loads host blocks back (``replace`` again).
Residency is monotone along a path: a device block's cached parent is a device block, so a
match is a run of device blocks followed by a run of host blocks.

``PrefixCache`` is the small interface the manager relies on; ``RadixPrefixCache`` is the
implementation. Another one (e.g. hash-chained blocks as in vLLM v1) can slot in if it
keeps the same invariants and reports a block's parent for the eviction-order check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvserve.core.errors import IntegrityError
from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.host_tier import HostBlock

BlockKey = tuple[int, ...]  # the block_size token ids of one full block
CacheEntry = KVBlock | HostBlock  # where a cached block's K/V lives: device pool or host tier


def describe(block: CacheEntry) -> str:
    """``"block 3"`` (device) or ``"host block 3"``, for messages."""
    if isinstance(block, HostBlock):
        return f"host block {block.host_block_id}"
    return f"block {block.block_id}"


class PrefixCache(Protocol):
    """What ``KVCacheManager`` needs from a prefix cache.

    Invariants every implementation keeps: only full blocks are cached; a block is cached
    under at most one path; ``block.cache_node`` is set exactly while it is cached; paths
    under different salts never share a block; ``evict`` is only asked for blocks without
    cached children.
    """

    block_size: int

    @property
    def num_cached_blocks(self) -> int:
        """How many blocks the cache maps."""
        ...

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_blocks: int
    ) -> list[CacheEntry]:
        """Blocks of the longest cached prefix of ``token_ids`` (at most ``max_blocks``)."""
        ...

    def insert(
        self, parent: CacheEntry | None, salt: str | None, key: BlockKey, block: CacheEntry
    ) -> bool:
        """Cache ``block`` as the block after ``parent`` (None: the first block) with tokens
        ``key``. Returns False, changing nothing, if that path is already cached."""
        ...

    def child(
        self, parent: CacheEntry | None, salt: str | None, key: BlockKey
    ) -> CacheEntry | None:
        """The block cached right after ``parent`` (None: a first block) for tokens ``key``,
        or None if that path is not cached."""
        ...

    def evict(self, block: CacheEntry) -> None:
        """Forget ``block``, which must be cached and have no cached children."""
        ...

    def replace(self, old: CacheEntry, new: CacheEntry) -> None:
        """Put uncached ``new`` where cached ``old`` is (same path); ``old`` is then uncached."""
        ...

    def remove_subtree(self, block: CacheEntry) -> list[CacheEntry]:
        """Forget ``block`` and every cached block below it; returns them, ``block`` first."""
        ...

    def parent_block(self, block: CacheEntry) -> CacheEntry | None:
        """The cached block before ``block`` on its path (None for a path's first block)."""
        ...

    def clear(self) -> None:
        """Forget every block."""
        ...

    def dump(self) -> list:
        """A plain, comparable description of the whole cache (tests, debugging)."""
        ...

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first broken invariant."""
        ...


class _Node:
    """One edge of the tree: a run of full blocks, plus the nodes that branch off its end.

    A root has no blocks and ``parent is None``. ``children`` is keyed by the first block
    key of each child edge. Apart from roots, no node has exactly one child (it would be
    merged with it).
    """

    __slots__ = ("parent", "keys", "blocks", "children", "salt")

    def __init__(
        self,
        parent: _Node | None,
        keys: list[BlockKey],
        blocks: list[CacheEntry],
        salt: str | None = None,
    ) -> None:
        self.parent = parent
        self.keys = keys  # one BlockKey per block
        self.blocks = blocks
        self.children: dict[BlockKey, _Node] = {}
        self.salt = salt  # meaningful on roots only

    def index_of(self, block: CacheEntry) -> int:
        """Position of ``block`` in this edge (O(1) for the last block, the common case)."""
        if self.blocks[-1] is block:
            return len(self.blocks) - 1
        for i, b in enumerate(self.blocks):
            if b is block:
                return i
        raise IntegrityError(f"{describe(block)} is not on its cache node's edge")


class RadixPrefixCache:
    """Radix tree of full token blocks, one root per salt. See the module docstring."""

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._roots: dict[str | None, _Node] = {}
        self._num_cached_blocks = 0

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_blocks

    def match(
        self, token_ids: Sequence[int], salt: str | None, max_blocks: int
    ) -> list[CacheEntry]:
        """Blocks of the longest cached block-aligned prefix of ``token_ids``.

        Walks one dict lookup per edge and one block-key comparison per block: O(matched
        blocks x block_size), independent of the cache's size.
        """
        out: list[CacheEntry] = []
        node = self._roots.get(salt)
        bs = self.block_size
        limit = min(max_blocks, len(token_ids) // bs)
        pos = 0
        while node is not None and len(out) < limit:
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            keys = child.keys
            n = min(len(keys), limit - len(out))
            pos += bs
            j = 1
            while j < n and keys[j] == tuple(token_ids[pos : pos + bs]):
                pos += bs
                j += 1
            out.extend(child.blocks[:j])
            if j < len(keys):
                break  # stopped inside the edge
            node = child
        return out

    def insert(
        self, parent: CacheEntry | None, salt: str | None, key: BlockKey, block: CacheEntry
    ) -> bool:
        """Cache ``block`` (tokens ``key``) right after ``parent`` on its path.

        ``parent`` is None for a sequence's first block, else a cached block. Returns False
        (nothing changes) if the cache already has a block for this path: the caller keeps
        its own copy uncached. Extends a leaf edge in place, splits an edge if ``parent``
        is in its middle, or adds a child edge.
        """
        if block.cache_node is not None:
            raise ValueError(f"{describe(block)} is already cached")
        if len(key) != self.block_size:
            raise ValueError(f"only full blocks are cached: key has {len(key)} tokens")
        node, inside = self._after(parent, salt)
        if node is None:
            node = self._roots[salt] = _Node(None, [], [], salt)
        elif inside is not None:  # parent sits inside an edge
            if node.keys[inside] == key:
                return False
            self._split(node, inside)
        if key in node.children:
            return False
        if node.parent is not None and not node.children:
            # A leaf edge just grows: the Patricia compression of a chain.
            node.keys.append(key)
            node.blocks.append(block)
            block.cache_node = node
        else:
            leaf = _Node(node, [key], [block])
            node.children[key] = leaf
            block.cache_node = leaf
        self._num_cached_blocks += 1
        return True

    def child(
        self, parent: CacheEntry | None, salt: str | None, key: BlockKey
    ) -> CacheEntry | None:
        """The block cached right after ``parent`` (None: a first block) for tokens ``key``."""
        node, inside = self._after(parent, salt)
        if node is None:
            return None
        if inside is not None:  # parent sits inside an edge
            return node.blocks[inside] if node.keys[inside] == key else None
        found = node.children.get(key)
        return None if found is None else found.blocks[0]

    def evict(self, block: CacheEntry) -> None:
        """Drop ``block``, the last block of a leaf edge; prune and re-merge the tree."""
        node = block.cache_node
        if not isinstance(node, _Node):
            raise ValueError(f"{describe(block)} is not cached")
        if node.blocks[-1] is not block or node.children:
            raise IntegrityError(
                f"prefix cache: evicting {describe(block)}, which has cached children"
            )
        node.blocks.pop()
        key = node.keys.pop()
        block.cache_node = None
        self._num_cached_blocks -= 1
        if not node.blocks:
            self._unlink(node, key)

    def replace(self, old: CacheEntry, new: CacheEntry) -> None:
        """Put ``new`` (uncached) in ``old``'s place on its path; ``old`` becomes uncached.

        O(edge length) at worst (O(1) when ``old`` ends its edge). The tree's shape and the
        number of cached blocks do not change.
        """
        node = old.cache_node
        if not isinstance(node, _Node):
            raise ValueError(f"{describe(old)} is not cached")
        if new.cache_node is not None:
            raise ValueError(f"{describe(new)} is already cached")
        node.blocks[node.index_of(old)] = new
        new.cache_node = node
        old.cache_node = None

    def remove_subtree(self, block: CacheEntry) -> list[CacheEntry]:
        """Forget ``block``, the rest of its edge and every node below it; prune and merge.

        Returns the forgotten blocks, ``block`` first (each now uncached).
        """
        node = block.cache_node
        if not isinstance(node, _Node):
            raise ValueError(f"{describe(block)} is not cached")
        at = node.index_of(block)
        removed = node.blocks[at:]
        first_key = node.keys[0]
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            removed.extend(child.blocks)
            stack.extend(child.children.values())
        for b in removed:
            b.cache_node = None
        self._num_cached_blocks -= len(removed)
        del node.keys[at:]
        del node.blocks[at:]
        node.children = {}
        if not node.blocks:
            self._unlink(node, first_key)
        return removed

    def parent_block(self, block: CacheEntry) -> CacheEntry | None:
        """The block before ``block`` on its path (previous on its edge, or the parent's last)."""
        node = block.cache_node
        if not isinstance(node, _Node):
            raise ValueError(f"{describe(block)} is not cached")
        i = node.index_of(block)
        if i > 0:
            return node.blocks[i - 1]
        parent = node.parent
        if parent is None:
            raise IntegrityError(f"{describe(block)} is cached on a root")
        return parent.blocks[-1] if parent.parent is not None else None

    def clear(self) -> None:
        """Forget every block (they stay wherever the pool has them)."""
        for node in self._nodes():
            for block in node.blocks:
                block.cache_node = None
        self._roots.clear()
        self._num_cached_blocks = 0

    def dump(self) -> list:
        """Sorted (salt, [(path depth, block key, block id), ...]) for every root.

        A host-resident block's id is written ``-1 - host block id``.
        """
        out = []
        for salt, root in self._roots.items():
            rows = []
            stack = [(root, 0)]
            while stack:
                node, depth = stack.pop()
                for k, b in zip(node.keys, node.blocks, strict=True):
                    bid = -1 - b.host_block_id if isinstance(b, HostBlock) else b.block_id
                    rows.append((depth, k, bid))
                    depth += 1
                stack.extend((c, depth) for c in node.children.values())
            out.append((str(salt), sorted(rows)))
        return sorted(out)

    def check_integrity(self) -> None:
        """Raise IntegrityError if the tree's shape, keys or block links are inconsistent."""
        seen: set[int] = set()  # id() of every cached block object
        for salt, root in self._roots.items():
            if root.parent is not None or root.salt != salt:
                raise IntegrityError(f"root for salt {salt!r} is wrong")
            if root.blocks or root.keys:
                raise IntegrityError(f"root for salt {salt!r} holds blocks")
            if not root.children:
                raise IntegrityError(f"root for salt {salt!r} is empty but kept")
        for node in self._nodes():
            if node.parent is None:
                continue
            if not node.blocks:
                raise IntegrityError("prefix cache: a non-root node has no blocks")
            if len(node.keys) != len(node.blocks):
                raise IntegrityError("prefix cache: keys and blocks differ")
            if node.parent.children.get(node.keys[0]) is not node:
                raise IntegrityError(
                    "prefix cache: node is not its parent's child under its first key"
                )
            if len(node.children) == 1:
                raise IntegrityError("prefix cache: node with one child is not merged")
            for key, child in node.children.items():
                if child.parent is not node or child.keys[0] != key:
                    raise IntegrityError("prefix cache: bad child")
            for key, block in zip(node.keys, node.blocks, strict=True):
                if len(key) != self.block_size:
                    raise IntegrityError(f"prefix cache: {describe(block)} is cached but not full")
                if block.cache_node is not node:
                    raise IntegrityError(
                        f"prefix cache: {describe(block)} does not point at its node"
                    )
                if id(block) in seen:
                    raise IntegrityError(f"prefix cache: {describe(block)} is cached twice")
                seen.add(id(block))
        if len(seen) != self._num_cached_blocks:
            raise IntegrityError(
                f"prefix cache: {len(seen)} blocks in the tree, "
                f"counter says {self._num_cached_blocks}"
            )

    # ------------------------------------------------------------------ internals

    def _after(
        self, parent: CacheEntry | None, salt: str | None
    ) -> tuple[_Node | None, int | None]:
        """Where the block after ``parent`` goes: (its edge's node, the index of the next
        block when ``parent`` sits inside that edge, else None: a child of the node).

        ``parent`` None: the salt's root (None if it has none yet).
        """
        if parent is None:
            return self._roots.get(salt), None
        node = parent.cache_node
        if not isinstance(node, _Node):
            raise ValueError(f"parent {describe(parent)} is not cached")
        nxt = node.index_of(parent) + 1
        return node, (nxt if nxt < len(node.keys) else None)

    def _nodes(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _unlink(self, node: _Node, key: BlockKey) -> None:
        """Detach the emptied ``node`` (first key ``key``) from its parent; prune and merge."""
        parent = node.parent
        if parent is None:
            raise IntegrityError("prefix cache: unlinking a root")
        del parent.children[key]
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.salt]
        elif len(parent.children) == 1:
            self._merge_only_child(parent)

    def _split(self, node: _Node, at: int) -> None:
        """Cut ``node``'s edge before block ``at``; the tail becomes its only child (for now)."""
        tail = _Node(node, node.keys[at:], node.blocks[at:])
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        for block in tail.blocks:
            block.cache_node = tail
        del node.keys[at:]
        del node.blocks[at:]
        node.children = {tail.keys[0]: tail}

    def _merge_only_child(self, node: _Node) -> None:
        """Fold ``node``'s single child edge into ``node`` (keeps the tree a Patricia tree)."""
        (child,) = node.children.values()
        node.keys.extend(child.keys)
        node.blocks.extend(child.blocks)
        for block in child.blocks:
            block.cache_node = node
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
