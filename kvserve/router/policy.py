"""Routing policies for data-parallel replicas (pure Python, no torch, no I/O).

The router (``kvserve/router/app.py``) and the simulator (``kvserve/sim/cluster.py``) both call
the same :class:`RoutingPolicy`: ``choose(key, loads)`` picks a replica for a request whose
prefix key is ``key`` (token ids, or the UTF-8 bytes of a text prompt) given the current load
of every healthy replica; ``on_routed(replica, key)`` records where it went.

:class:`PrefixAwarePolicy` keeps an approximate radix tree of the keys sent to each replica,
bounded in memory (``max_tree_tokens`` elements in all) and trimmed least-recently-used first,
as SGLang's router does. It sends a request to the replica with the longest match unless that
replica's load exceeds the least-loaded one's by more than ``balance_margin`` requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

ROUTING_POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass(slots=True)
class _Node:
    """One edge of the tree: ``edge`` elements below ``parent``, and who was sent them."""

    edge: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    # replica -> tick of its last request through this node
    replicas: dict[str, int] = field(default_factory=dict)


class PrefixTree:
    """Approximate radix tree of the prefixes routed to each replica.

    Approximate: it records what the router sent, not what each replica still caches (a
    replica may have evicted it), and it is trimmed on its own LRU clock. Invariant: a replica
    marked on a node is marked on all its ancestors (insertion marks the whole path).
    """

    def __init__(self, max_tokens: int = 1 << 21) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.root = _Node((), None)
        self.num_tokens = 0  # elements stored on all edges
        self._tick = itertools.count(1)

    def insert(self, key: Sequence[int], replica: str) -> None:
        """Mark every prefix of ``key`` as sent to ``replica``; trims when over the bound."""
        tick = next(self._tick)
        key = tuple(key[: self.max_tokens])
        node = self.root
        node.replicas[replica] = tick
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = _Node(key[i:], node)
                node.children[key[i]] = child
                self.num_tokens += len(key) - i
                child.replicas[replica] = tick
                break
            n = _common_len(child.edge, key, i)
            if n < len(child.edge):
                child = self._split(child, n)
            child.replicas[replica] = tick
            node = child
            i += n
        if self.num_tokens > self.max_tokens:
            self.trim(self.max_tokens * 9 // 10)

    def match(self, key: Sequence[int]) -> dict[str, int]:
        """Replica -> length of the longest prefix of ``key`` sent to it (absent: 0)."""
        out: dict[str, int] = {}
        node = self.root
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.edge, key, i)
            for r in child.replicas:
                out[r] = i + n
            if n < len(child.edge):
                break
            node = child
            i += n
        return out

    def remove_replica(self, replica: str) -> None:
        """Forget everything sent to ``replica`` (it left the pool: its cache is unknown)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.replicas.pop(replica, None)
            for child in list(node.children.values()):
                if replica in child.replicas and len(child.replicas) == 1:
                    self._drop_subtree(child)
                else:
                    stack.append(child)

    def trim(self, target_tokens: int) -> None:
        """Drop least-recently-used leaves until at most ``target_tokens`` elements remain."""
        leaves = [n for n in self._nodes() if not n.children and n is not self.root]
        leaves.sort(key=lambda n: max(n.replicas.values(), default=0))
        heap_i = 0
        while self.num_tokens > target_tokens and heap_i < len(leaves):
            leaf = leaves[heap_i]
            heap_i += 1
            parent = leaf.parent
            self._drop_subtree(leaf)
            # NOTE: a parent left childless becomes a leaf; it is as old as its newest child
            # at most, so appending keeps the order approximately LRU.
            if parent is not None and parent is not self.root and not parent.children:
                leaves.append(parent)

    def check_integrity(self) -> None:
        """Assert the size count and the ancestor-marking invariant."""
        total = 0
        for node in self._nodes():
            total += len(node.edge)
            if node.parent is not None and node.parent is not self.root:
                assert set(node.replicas) <= set(node.parent.replicas), "unmarked ancestor"
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first and child.parent is node
        assert total == self.num_tokens, f"size {self.num_tokens} != counted {total}"

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` elements; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:n], parent, replicas=dict(child.replicas))
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _drop_subtree(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.edge[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            self.num_tokens -= len(n.edge)
            stack.extend(n.children.values())


def _common_len(edge: tuple[int, ...], key: Sequence[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class RoutingPolicy(Protocol):
    """Chooses a replica; ``loads`` holds every healthy replica (running + waiting)."""

    name: str

    def choose(self, key: Sequence[int], loads: Mapping[str, int]) -> str: ...

    def on_routed(self, replica: str, key: Sequence[int]) -> None: ...

    def remove_replica(self, replica: str) -> None: ...


def _check_loads(loads: Mapping[str, int]) -> None:
    if not loads:
        raise LookupError("no healthy replica")


class RoundRobinPolicy:
    """Each request to the next healthy replica in name order."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, key: Sequence[int], loads: Mapping[str, int]) -> str:
        """The next replica in turn."""
        _check_loads(loads)
        names = sorted(loads)
        replica = names[self._next % len(names)]
        self._next += 1
        return replica

    def on_routed(self, replica: str, key: Sequence[int]) -> None:
        """Nothing to remember."""

    def remove_replica(self, replica: str) -> None:
        """Nothing to forget."""


class LeastLoadedPolicy(RoundRobinPolicy):
    """The replica with the fewest running + waiting requests (ties: name order)."""

    name = "least-loaded"

    def choose(self, key: Sequence[int], loads: Mapping[str, int]) -> str:
        """The least-loaded replica."""
        _check_loads(loads)
        return min(sorted(loads), key=lambda r: loads[r])


class PrefixAwarePolicy:
    """Longest routed prefix wins, unless its replica is overloaded against the least-loaded.

    ``balance_margin``: the longest-match replica is taken while its load is at most the
    least-loaded replica's load + margin; beyond that the least-loaded replica is taken (ties:
    the longer match, then fewer requests routed so far, then name order). A match counts only
    when it is at least ``min_match`` elements and ``min_match_ratio`` of the key (SGLang's
    ``cache_threshold``, 0.5 there too): two tenants whose system prompts share a first few
    words do not pull each other's traffic. A request with no counted match goes to the
    least-loaded replica.
    """

    name = "prefix"

    def __init__(
        self,
        *,
        balance_margin: int = 4,
        max_tree_tokens: int = 1 << 21,
        min_match: int = 1,
        min_match_ratio: float = 0.5,
    ) -> None:
        if balance_margin < 0:
            raise ValueError(f"balance_margin must be >= 0, got {balance_margin}")
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if not 0.0 <= min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio}")
        self.balance_margin = balance_margin
        self.min_match = min_match
        self.min_match_ratio = min_match_ratio
        self.tree = PrefixTree(max_tree_tokens)
        self.last_match_len = 0  # matched elements of the last choice (for metrics)
        # NOTE: breaks load ties on unmatched requests, so that new prefixes spread over idle
        # replicas instead of all landing on the first name.
        self.num_routed: dict[str, int] = {}

    def choose(self, key: Sequence[int], loads: Mapping[str, int]) -> str:
        """See the class docstring."""
        _check_loads(loads)
        names = sorted(loads)
        matches = self.tree.match(key)
        min_load = min(loads.values())
        floor = max(self.min_match, self.min_match_ratio * len(key))

        def matched(r: str) -> int:
            m = matches.get(r, 0)
            return m if m >= floor else 0

        routed = self.num_routed
        best = min(names, key=lambda r: (-matched(r), loads[r], routed.get(r, 0)))
        if matched(best) == 0 or loads[best] > min_load + self.balance_margin:
            best = min(names, key=lambda r: (loads[r], -matched(r), routed.get(r, 0)))
        self.last_match_len = matched(best)
        return best

    def on_routed(self, replica: str, key: Sequence[int]) -> None:
        """Record that ``key`` went to ``replica``."""
        self.tree.insert(key, replica)
        self.num_routed[replica] = self.num_routed.get(replica, 0) + 1

    def remove_replica(self, replica: str) -> None:
        """Forget the replica's prefixes."""
        self.tree.remove_replica(replica)
        self.num_routed.pop(replica, None)


def make_policy(
    name: str,
    *,
    balance_margin: int = 4,
    max_tree_tokens: int = 1 << 21,
    min_match_ratio: float = 0.5,
) -> RoutingPolicy:
    """A policy by its ``--routing`` name; ValueError naming the choices otherwise."""
    if name == "prefix":
        return PrefixAwarePolicy(
            balance_margin=balance_margin,
            max_tree_tokens=max_tree_tokens,
            min_match_ratio=min_match_ratio,
        )
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    raise ValueError(
        f"unknown routing policy {name!r}; expected one of {', '.join(ROUTING_POLICIES)}"
    )
