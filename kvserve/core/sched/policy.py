"""Preemption policy: which running request gives up its blocks when memory runs out.

Invariants every policy must keep (the scheduler relies on them):

- ``sort_key`` is a total order that does not change while a request is running: the
  scheduler serves running requests in ascending key order each step ("most important
  first"), so the request being served is never less important than the ones after it.
- ``select_victim`` returns one of ``candidates`` (never an empty choice). The scheduler only
  offers requests that have not been scheduled yet in the current step, plus the request that
  needs the block; a policy consistent with ``sort_key`` picks the least important of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvserve.request import Request

SortKey = tuple[int | float | str, ...]


class PreemptionPolicy(ABC):
    """Orders requests by importance and picks preemption victims."""

    @abstractmethod
    def sort_key(self, request: Request) -> SortKey:
        """Ascending key: smaller means more important (served first, preempted last)."""

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        """The request to preempt among ``candidates``: by default the largest ``sort_key``."""
        if not candidates:
            raise ValueError("select_victim needs at least one candidate")
        return max(candidates, key=self.sort_key)


class PriorityPolicy(PreemptionPolicy):
    """Default: lowest priority first (largest ``priority`` value), then latest arrival.

    Ties on arrival are broken by ``sample_index`` (an n > 1 child goes before its parent)
    and finally by ``request_id`` so that the order is total and deterministic.
    """

    def sort_key(self, request: Request) -> SortKey:
        return (request.priority, request.arrival_time, request.sample_index, request.request_id)
