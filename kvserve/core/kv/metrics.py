"""Capacity figures of the KV cache, in one place (names as in DESIGN.md and CONTRACTS.md).

``KVCacheCounters`` holds the monotonic counters the manager bumps on its paths;
``kv_utilization`` and ``ratio`` turn state into the derived figures that
``capacity_figures`` gathers for ``KVCacheManager.snapshot()``:

- kv_usage: blocks referenced by live requests / total blocks (cached-but-free ones don't
  count).
- kv_utilization: tokens actually stored / (allocated blocks x block_size) over live
  requests, a block shared by several tables counted once; fragmentation = 1 - utilization.
  Both are 0 when nothing is allocated.
- prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens looked up,
  both tiers (device_hit_tokens + host_hit_tokens = prefix_cache_hits).
- offload_blocks / load_blocks: blocks moved device -> host / host -> device by the host
  prefix tier (swap_out_blocks / swap_in_blocks count swap preemption); bytes moved =
  blocks x the runtime's bytes per block.
- ``HostTransferStats``: measured time of those copies (load, offload, swap in/out) and the
  load-vs-recompute comparison (``host_tier_load_vs_recompute`` < 1: loading was cheaper).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Protocol

from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class KVCacheCounters:
    """Monotonic counters of the KV cache manager (reset only by a new manager)."""

    prefix_cache_queries: int = 0  # tokens looked up at first allocations
    prefix_cache_hits: int = 0  # of which served from the prefix cache
    cow_copies: int = 0  # (src, dst) block copies queued by copy-on-write
    fork_shared_blocks: int = 0  # blocks shared instead of copied by fork()
    dedup_blocks: int = 0  # duplicates of cached blocks swapped for their twin (prefix_hits)
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0  # blocks copied back (prefix-cache hits at swap-in need none)
    device_hit_tokens: int = 0  # prefix hits served by device-resident blocks
    host_hit_tokens: int = 0  # prefix hits served by host-resident blocks (loaded back)
    offload_blocks: int = 0  # evicted cached blocks copied device -> host (prefix tier)
    load_blocks: int = 0  # host-resident prefix blocks copied host -> device on a hit
    host_cache_evictions: int = 0  # offloaded blocks dropped from the host tier
    alloc_time_s: float = 0.0  # time.perf_counter() spent in allocate_slots / swap_in
    alloc_calls: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """The counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def record_prefix_query(self, num_tokens: int, num_hit: int, num_host_hit: int) -> None:
        """A first allocation looked up ``num_tokens`` tokens and hit ``num_hit`` of them,
        ``num_host_hit`` in host-resident blocks."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit
        self.host_hit_tokens += num_host_hit
        self.device_hit_tokens += num_hit - num_host_hit

    @contextmanager
    def timing_alloc(self) -> Iterator[None]:
        """Count one allocation call and its time (``alloc_calls``, ``alloc_time_s``).

        NOTE: for ``swap_in`` (rare); ``allocate_slots``, a hot path, counts inline.
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.alloc_time_s += time.perf_counter() - t0
            self.alloc_calls += 1


class _EvictingPool(Protocol):
    @property
    def num_evictions(self) -> int: ...


class _CachingHostTier(Protocol):
    @property
    def num_cached_blocks(self) -> int: ...


class KVCapacitySource(Protocol):
    """What ``capacity_figures`` reads of a KV cache manager: its public state
    (``KVCacheManager`` and its variants have it; the Protocol keeps this module below them)."""

    @property
    def counters(self) -> KVCacheCounters: ...
    @property
    def block_pool(self) -> _EvictingPool: ...
    @property
    def host_tier(self) -> _CachingHostTier: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def num_free_host_blocks(self) -> int: ...


def capacity_figures(
    kv: KVCapacitySource, utilization: float, has_tables: bool
) -> dict[str, float | int]:
    """``KVCacheManager.snapshot()``: every capacity figure by name, from the manager's
    public state plus its ``utilization`` and whether it ``has_tables`` (any live one)."""
    c = kv.counters
    return {
        "num_kv_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "num_free_blocks": kv.num_free_blocks,
        "kv_usage": kv.usage,
        "kv_utilization": utilization,
        # NOTE: 0 when idle (nothing allocated), 1 when blocks are allocated but empty.
        "fragmentation": 1.0 - utilization if has_tables else 0.0,
        "prefix_hit_rate": ratio(c.prefix_cache_hits, c.prefix_cache_queries),
        "prefix_cache_evictions": kv.block_pool.num_evictions,
        "num_host_blocks": kv.num_host_blocks,
        "num_free_host_blocks": kv.num_free_host_blocks,
        "host_cache_blocks": kv.host_tier.num_cached_blocks,
        **c.as_dict(),  # every counter by its name
    }


def ratio(num: float, den: float) -> float:
    """``num / den``, or 0.0 when ``den`` is 0 (an idle engine reports zeros, not NaN)."""
    return num / den if den else 0.0


def kv_utilization(
    tables: Iterable[tuple[Sequence[int], int]], block_size: int, *, skip_id: int | None = None
) -> float:
    """Tokens stored / (distinct allocated blocks x block_size).

    ``tables`` yields (block ids, number of computed tokens) per live request. Token p of
    a request sits in its block p // block_size, so a block is as full as the furthest any
    of its holders has computed into it. O(total table length), at C speed for full blocks.
    Entries equal to ``skip_id`` (freed, skipped blocks) hold nothing and are not counted.
    """
    filled: dict[int, int] = {}
    for block_ids, num_computed in tables:
        num_full = min(num_computed // block_size, len(block_ids))
        filled.update(dict.fromkeys(block_ids[:num_full], block_size))
        if num_full < len(block_ids):
            partial = block_ids[num_full]
            used = num_computed - num_full * block_size  # < block_size here
            filled[partial] = max(filled.get(partial, 0), used)
            for block_id in block_ids[num_full + 1 :]:
                filled.setdefault(block_id, 0)
    if skip_id is not None:
        filled.pop(skip_id, None)
    return ratio(sum(filled.values()), len(filled) * block_size)


@dataclass(slots=True)
class HostTransferStats:
    """Measured host <-> device KV copy time, by cause, and the prefill rate it is judged by.

    The runner times a step's swap-out (device -> host) and swap-in (host -> device) copies
    (``ModelRunnerOutput.swap_out_time`` / ``swap_in_time``). A step's copies mix two
    causes: the host prefix tier (offloads of evicted cached blocks, loads of host hits) and
    swap preemption; the manager's ``offload_blocks`` / ``load_blocks`` counters say how many
    of the step's pairs were the tier's. Load vs recompute: a loaded block saves recomputing
    its tokens, which would have cost the engine's measured prefill rate (forward seconds of
    the steps that computed prefill tokens / the tokens those steps computed).
    """

    load_seconds: float = 0.0  # prefix tier: host-resident blocks loaded back on a hit
    load_blocks: int = 0
    offload_seconds: float = 0.0  # prefix tier: evicted cached blocks saved to the host
    offload_blocks: int = 0
    swap_in_seconds: float = 0.0  # swap preemption: a swapped-out request's blocks back in
    swap_in_blocks: int = 0
    swap_out_seconds: float = 0.0  # swap preemption: a preempted request's blocks out
    swap_out_blocks: int = 0
    prefill_seconds: float = 0.0  # forward seconds (copies excluded) of steps with a prefill
    prefill_step_tokens: int = 0  # tokens those steps computed (their decodes included)
    _seen_load_blocks: int = 0  # the manager's counters at the last record()
    _seen_offload_blocks: int = 0

    def record(self, sched: SchedulerOutput, out: ModelRunnerOutput, kv: KVCacheCounters) -> None:
        """Add one executed step; ``kv`` is the manager's counters after scheduling it."""
        num_loads = kv.load_blocks - self._seen_load_blocks
        num_offloads = kv.offload_blocks - self._seen_offload_blocks
        self._seen_load_blocks, self._seen_offload_blocks = kv.load_blocks, kv.offload_blocks
        # NOTE: a step's pairs of both causes go in one batched copy of equal-sized blocks,
        # so its time is split in proportion to the blocks (exact when one cause is alone,
        # as in nearly every step).
        num_in, num_out = len(sched.blocks_to_swap_in), len(sched.blocks_to_swap_out)
        num_loads = min(max(num_loads, 0), num_in)
        num_offloads = min(max(num_offloads, 0), num_out)
        load_time = out.swap_in_time * ratio(num_loads, num_in)
        offload_time = out.swap_out_time * ratio(num_offloads, num_out)
        self.load_seconds += load_time
        self.load_blocks += num_loads
        self.swap_in_seconds += out.swap_in_time - load_time
        self.swap_in_blocks += num_in - num_loads
        self.offload_seconds += offload_time
        self.offload_blocks += num_offloads
        self.swap_out_seconds += out.swap_out_time - offload_time
        self.swap_out_blocks += num_out - num_offloads
        if any(len(r.token_ids) > 1 for r in sched.scheduled):
            forward = out.execute_time - out.swap_in_time - out.swap_out_time
            self.prefill_seconds += max(forward, 0.0)
            self.prefill_step_tokens += sched.total_num_scheduled_tokens

    def as_dict(self, block_size: int) -> dict[str, float | int]:
        """The figures by their ``stats()`` names (seconds, blocks, tokens, ratios).

        ``prefill_seconds_per_token`` is an average over whole steps: it includes each step's
        fixed overhead, so for short chunks it overstates the marginal cost of one more token.
        """
        load_tokens = self.load_blocks * block_size
        prefill_rate = ratio(self.prefill_seconds, self.prefill_step_tokens)
        recompute = load_tokens * prefill_rate
        return {
            "host_load_seconds": self.load_seconds,
            "host_load_blocks": self.load_blocks,
            "host_load_tokens": load_tokens,
            "host_load_seconds_per_token": ratio(self.load_seconds, load_tokens),
            "host_offload_seconds": self.offload_seconds,
            "host_offload_blocks": self.offload_blocks,
            "swap_in_seconds": self.swap_in_seconds,
            "swap_out_seconds": self.swap_out_seconds,
            "prefill_seconds_per_token": prefill_rate,
            "host_load_recompute_seconds": recompute,
            "host_tier_load_vs_recompute": ratio(self.load_seconds, recompute),
        }
