"""Capacity figures and the state dump of ``HybridKVCacheManager`` (a mixin over its state).

``snapshot`` gives the figures of ``KVCacheManager.snapshot`` (CONTRACTS.md) with kv_usage and
kv_utilization over every group's live blocks, plus ``window_freed_blocks`` (blocks freed
as they left a sliding window) and ``num_kv_groups``.
"""

from __future__ import annotations

from kvserve.core.kv.block_pool import BlockPool, KVBlock
from kvserve.core.kv.hybrid_prefix import GroupPrefixCache
from kvserve.core.kv.hybrid_swap import HostGroups
from kvserve.core.kv.kv_groups import KVGroupSpec
from kvserve.core.kv.metrics import capacity_figures, kv_utilization
from kvserve.core.kv.tables import BlockTable


class HybridFigures:
    """``snapshot`` and ``dump_state`` over the manager's tables, pool and caches."""

    groups: tuple[KVGroupSpec, ...]
    block_size: int
    num_window_freed_blocks: int
    _tables: list[dict[str, BlockTable]]
    _swapped: dict[str, HostGroups]
    _pool: BlockPool
    _null: KVBlock
    _caches: list[GroupPrefixCache]
    _pending_copies: list[tuple[KVBlock, KVBlock]]

    def snapshot(self) -> dict[str, float | int]:
        """Every capacity figure by name (as ``KVCacheManager.snapshot``) plus the freed
        window blocks and the groups' count."""
        tables = [
            ([b.block_id for b in t.blocks], t.request.num_computed_tokens)
            for g in self._tables
            for t in g.values()
        ]
        util = kv_utilization(tables, self.block_size, skip_id=self._null.block_id)
        d = capacity_figures(self, util, bool(tables))  # type: ignore[arg-type]
        d["window_freed_blocks"] = self.num_window_freed_blocks
        d["num_kv_groups"] = len(self.groups)
        return d

    def dump_state(self) -> dict[str, object]:
        """The state as plain comparable data (timing counters left out)."""
        figures = self.snapshot()
        del figures["alloc_time_s"], figures["alloc_calls"]
        return {
            "tables": [
                {rid: [b.block_id for b in t.blocks] for rid, t in g.items()} for g in self._tables
            ],
            "free_block_ids": self._pool.free_block_ids(),
            "ref_cnts": [b.ref_cnt for b in self._pool.blocks],
            "cached": [sorted(b.block_id for b in c.blocks.values()) for c in self._caches],
            "host_tables": {
                rid: [(n, [(i, h.host_block_id) for i, h in p]) for n, p in rec]
                for rid, rec in self._swapped.items()
            },
            "pending_copies": [(s.block_id, d.block_id) for s, d in self._pending_copies],
            "figures": figures,
        }
