"""Per-request block tables: the records ``KVCacheManager`` keeps for each request.

``BlockTable``: token p of the request lives in ``blocks[p // block_size]`` at offset
``p % block_size``. An entry may be the pool's null block (``NULL_BLOCK_ID``): a block the
manager freed because no later query reads it (``KVCacheManager.remove_skipped_blocks``).
``HostTable``: a swapped-out request's blocks in the host tier, in table order.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.kv.block_pool import KVBlock
from kvserve.core.kv.host_tier import HostBlock
from kvserve.request import Request


@dataclass(slots=True, eq=False)
class BlockTable:
    """The device block table of one request."""

    request: Request
    blocks: list[KVBlock]
    num_cached_blocks: int = 0  # blocks[:n] are this request's own path in the prefix cache
    num_full_checked: int = 0  # full blocks already offered to the prefix cache
    # Speculative decoding: slots past the request's known tokens that hold draft tokens
    # until verification (``BlockTableManager.set_lookahead`` / ``release_rejected``).
    num_lookahead: int = 0

    def token_ids(self) -> list[int]:
        """Prompt + output of the request (no copy while there is no output yet)."""
        return request_token_ids(self.request)


@dataclass(slots=True, eq=False)
class HostTable:
    """A swapped-out request: its blocks live in the host tier, in table order."""

    request: Request
    host_blocks: list[HostBlock]


def request_token_ids(request: Request) -> list[int]:
    """Prompt + output without a copy when there is no output yet."""
    return request.all_token_ids if request.output_token_ids else request.prompt_token_ids
