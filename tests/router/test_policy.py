"""The routing policies on exact scripted prefixes and loads (pure Python, milliseconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.router.keys import TEXT_OFFSET, request_key
from kvserve.router.policy import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    PrefixTree,
    RoundRobinPolicy,
    make_policy,
)


def test_tree_match_lengths_per_replica() -> None:
    t = PrefixTree()
    t.insert([1, 2, 3, 4, 5], "a")
    t.insert([1, 2, 3, 9], "b")
    t.insert([7, 8], "a")
    assert t.match([1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 3}
    assert t.match([1, 2, 3, 9, 9]) == {"a": 3, "b": 4}
    assert t.match([1, 2]) == {"a": 2, "b": 2}
    assert t.match([7, 9]) == {"a": 1}
    assert t.match([5]) == {}
    t.check_integrity()
    assert t.num_tokens == 5 + 1 + 2  # [1,2,3] + [4,5] + [9] + [7,8]


def test_tree_remove_replica_keeps_the_others() -> None:
    t = PrefixTree()
    t.insert([1, 2, 3, 4], "a")
    t.insert([1, 2, 8], "b")
    t.remove_replica("a")
    t.check_integrity()
    assert t.match([1, 2, 3, 4]) == {"b": 2}
    assert t.num_tokens == 3  # [1,2] + [8]: a's own branch is gone


def test_tree_is_bounded_and_trims_least_recently_used() -> None:
    t = PrefixTree(max_tokens=100)
    for i in range(10):
        t.insert([i] * 20, f"r{i % 2}")  # 200 elements offered
        assert t.num_tokens <= 100
        t.check_integrity()
    # the newest prefixes survive, the oldest went first
    assert t.match([9] * 20) == {"r1": 20}
    assert t.match([8] * 20) == {"r0": 20}
    assert t.match([0] * 20) == {}


def test_tree_refresh_keeps_a_hot_prefix() -> None:
    t = PrefixTree(max_tokens=60)
    t.insert([1] * 20, "a")
    for i in range(2, 10):
        t.insert([i] * 20, "b")
        t.insert([1] * 20, "a")  # touched again each time: stays the most recent
    assert t.match([1] * 20) == {"a": 20}


def test_prefix_policy_longest_match_wins() -> None:
    p = PrefixAwarePolicy(balance_margin=2, min_match_ratio=0.0)
    loads = {"a": 0, "b": 0}
    p.on_routed("a", [1, 2, 3, 4])
    p.on_routed("b", [1, 2, 5])
    assert p.choose([1, 2, 3, 4, 9], loads) == "a"
    assert p.last_match_len == 4
    assert p.choose([1, 2, 5, 6], loads) == "b"
    # no match at all: the least-loaded
    assert p.choose([42], {"a": 3, "b": 1}) == "b"
    assert p.last_match_len == 0


def test_prefix_policy_overload_margin() -> None:
    p = PrefixAwarePolicy(balance_margin=2, min_match_ratio=0.0)
    p.on_routed("a", [1, 2, 3])
    # within the margin (a's load 3 <= min 1 + 2): the match wins
    assert p.choose([1, 2, 3], {"a": 3, "b": 1}) == "a"
    # beyond it (4 > 1 + 2): the least-loaded
    assert p.choose([1, 2, 3], {"a": 4, "b": 1}) == "b"
    # equal matches: the lower load
    p.on_routed("b", [1, 2, 3])
    assert p.choose([1, 2, 3], {"a": 2, "b": 1}) == "b"
    # a replica missing from loads (unhealthy) is never chosen
    assert p.choose([1, 2, 3], {"c": 9}) == "c"


def test_prefix_policy_short_partial_matches_do_not_count() -> None:
    p = PrefixAwarePolicy(min_match_ratio=0.5)
    p.on_routed("a", [1, 2, 3, 4, 5, 6, 7, 8])
    loads = {"a": 1, "b": 0}
    assert p.choose([1, 2, 3, 9, 9, 9, 9, 9], loads) == "b"  # 3 of 8 < half
    assert p.choose([1, 2, 3, 4, 9, 9, 9, 9], loads) == "a"  # 4 of 8
    with pytest.raises(ValueError, match="min_match_ratio"):
        PrefixAwarePolicy(min_match_ratio=1.5)


def test_prefix_policy_spreads_groups_then_sticks() -> None:
    """Scripted run: 3 system prompts over 2 replicas; each prompt sticks to its replica."""
    p = PrefixAwarePolicy(balance_margin=4)
    loads = {"a": 0, "b": 0}
    chosen: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    for i in range(30):
        g = i % 3
        key = [100 + g] * 50 + [i]
        r = p.choose(key, loads)
        p.on_routed(r, key)
        chosen[g].add(r)
        loads[r] += 1
        if i % 3 == 2:  # a round of requests finishes
            loads = {"a": 0, "b": 0}
    assert all(len(s) == 1 for s in chosen.values()), chosen
    assert {next(iter(s)) for s in chosen.values()} == {"a", "b"}


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobinPolicy()
    loads = {"b": 5, "a": 0, "c": 1}
    assert [rr.choose([], loads) for _ in range(4)] == ["a", "b", "c", "a"]
    ll = LeastLoadedPolicy()
    assert ll.choose([], loads) == "a"
    assert ll.choose([], {"b": 1, "c": 1}) == "b"


def test_no_healthy_replica_and_bad_names() -> None:
    for policy in (PrefixAwarePolicy(), RoundRobinPolicy(), LeastLoadedPolicy()):
        with pytest.raises(LookupError, match="no healthy replica"):
            policy.choose([1], {})
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="balance_margin"):
        PrefixAwarePolicy(balance_margin=-1)


def test_request_keys() -> None:
    assert request_key({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert request_key({"prompt": [[5, 6], [8]]}) == [5, 6]
    assert request_key({"prompt": "hi"}) == [TEXT_OFFSET + ord("h"), TEXT_OFFSET + ord("i")]
    a = request_key(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]}
    )
    b = request_key(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "y"}]}
    )
    n = len("system\0S\0user\0")
    assert a[:n] == b[:n] and a[n] != b[n]
    assert request_key({"model": "m"}) == []


def test_policy_and_keys_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import kvserve.router.policy, kvserve.router.keys, kvserve.sim.cluster\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
