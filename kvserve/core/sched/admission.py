"""The scheduler's admission control: who may ever run, in what order, and when one may start.

- ``validate_request``: ``Scheduler.add_request``'s checks (a request that can never run is
  a ValueError naming the limit).
- ``waiting_key``: the waiting queue's order: (priority, preempted-first, arrival).
- ``AdmissionControl``: seats, headroom and hysteresis, the rules of the scheduler's steps 3
  (swap-in) and 4 (admission):

  - Seats: running requests plus their unforked n > 1 children stay within
    ``max_num_seqs`` capped at ``max_num_batched_tokens`` (``SchedulerConfig.max_running``).
  - Headroom: a request is admitted only if the blocks of all its known tokens (after
    prefix-cache hits) fit while ``ceil(admission_headroom * num_blocks)`` blocks stay free.
    Only the first chunk is allocated now; the rest of the prompt is held back as
    ``reserve`` in ``KVCacheManager.allocate_slots`` (``AdmissionControl.reserve``).
  - Hysteresis: a preemption closes admission; it reopens once ``num_free_blocks`` reaches
    ``ceil(resume_watermark * num_blocks)``, so the engine does not thrash between admitting
    and evicting.
  - No deadlock: when nothing is running, the head is admitted (or swapped in) if it fits in
    the pool at all, regardless of headroom and hysteresis (the scheduler's ``alone``).
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from kvserve.config import SchedulerConfig
from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


def fraction_to_blocks(fraction: float, num_blocks: int) -> int:
    """``ceil(fraction * num_blocks)``, robust to float error."""
    # NOTE: the epsilon keeps e.g. 0.1 * 30 = 3.0000000000000004 from rounding up to 4.
    return math.ceil(fraction * num_blocks - 1e-9)


def waiting_key(request: Request) -> tuple:
    """Sort key of the waiting queue: priority, then recompute-preempted requests ahead of
    fresh ones of the same priority, then (re)queue time."""
    preempted_first = 0 if request.status == RequestStatus.PREEMPTED else 1
    queued_at = request.arrival_time if request.requeue_time is None else request.requeue_time
    key = (request.priority, preempted_first, queued_at, request.sample_index)
    return (*key, request.request_id)


def validate_request(
    request: Request, config: SchedulerConfig, kv: KVCacheManager, known_ids: Container[str]
) -> None:
    """ValueError naming the limit if ``request`` (with its pending children) can never run.

    Empty prompt, an id in ``known_ids``, prompt + max_tokens beyond max_model_len (with
    max_tokens None: a prompt that leaves no room for one token), more blocks than the whole
    pool, more samples than max_num_seqs, or (chunked prefill disabled) a prompt beyond
    max_num_batched_tokens.
    """
    cfg = config
    rid = request.request_id
    if request.status != RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed)")
    for r in (request, *request.pending_children):
        if r.request_id in known_ids:
            raise ValueError(f"request id {r.request_id!r} is already in use")
    for child in request.pending_children:
        if child.parent_id != rid or child.prompt_token_ids != request.prompt_token_ids:
            raise ValueError(f"pending child {child.request_id!r} must share parent {rid!r}")
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise ValueError(f"request {rid!r} has an empty prompt")
    if 1 + len(request.pending_children) > cfg.max_num_seqs:
        raise ValueError(f"request {rid!r} has more samples than max_num_seqs={cfg.max_num_seqs}")
    max_tokens = request.max_tokens
    need = num_prompt + (max_tokens if max_tokens is not None else 1)
    if need > cfg.max_model_len:
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt}) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len={cfg.max_model_len}"
        )
    # NOTE: without max_tokens, the prompt and one more token: the first output token's KV
    # (or, when the prompt's last block comes whole from the prefix cache, the copy it is
    # recomputed into: an n > 1 child's too) must fit. A block-aligned prompt that filled
    # the pool exactly was admitted and then could not run alone, which stopped the engine.
    num_tokens = num_prompt + (max_tokens if max_tokens is not None else 1)
    if kv.max_live_blocks(num_tokens) > kv.num_blocks:
        raise ValueError(
            f"request {rid!r} needs {kv.max_live_blocks(num_tokens)} KV blocks at once for "
            f"{num_tokens} tokens, more than the whole pool (num_kv_blocks={kv.num_blocks})"
        )
    if not cfg.enable_chunked_prefill and num_prompt > cfg.max_num_batched_tokens:
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt}) exceeds max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens} and chunked prefill is disabled"
        )


class AdmissionControl:
    """Seats, headroom and the hysteresis gate (module docstring). Holds only the gate's
    state (``closed``); the running requests and the free blocks are passed in."""

    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.max_running = config.max_running
        self.seat_share = config.seat_share
        self.headroom_blocks = fraction_to_blocks(config.admission_headroom, num_blocks)
        self.resume_blocks = fraction_to_blocks(config.resume_watermark, num_blocks)
        self.closed = False  # set by a preemption, cleared at the resume watermark

    def is_open(self, num_free_blocks: int) -> bool:
        """Hysteresis: closed by a preemption until the free blocks reach the watermark."""
        self.closed = self.waits(num_free_blocks)
        return not self.closed

    def waits(self, num_free_blocks: int) -> bool:
        """The ``admission_closed`` figure: closed and still below the resume watermark.

        NOTE: ``closed`` is cleared only when a step next checks the gate (``is_open``), so
        read alone it stayed 1 on an idle engine whose pool was all free after a preemption.
        """
        return self.closed and num_free_blocks < self.resume_blocks

    def reserved_children(self, request: Request) -> int:
        """Unforked children that fork with the parent: up to its share of the seats."""
        return min(len(request.pending_children), self.seat_share - 1)

    def num_seats(self, running: Sequence[Request]) -> int:
        """Running requests plus the unforked children they reserved (of max_running)."""
        return len(running) + sum(self.reserved_children(r) for r in running)

    def has_seat(self, request: Request, running: Sequence[Request]) -> bool:
        """True if ``request`` and its reserved children fit in the free seats."""
        need = 1 + self.reserved_children(request)
        return self.num_seats(running) + need <= self.max_running

    def num_to_fork(self, parent: Request, running: Sequence[Request], *, others_wait: bool) -> int:
        """How many of the parent's pending n > 1 children fork now (its prompt is computed).

        While ``others_wait``, only its reserved share; the other samples queue behind them (a
        prefix-cache hit restores the prompt). Else every sample that finds a free seat.
        """
        reserved = self.reserved_children(parent)
        if others_wait:
            return reserved
        seats_of_others = self.num_seats(running) - reserved  # the parent's own seat included
        return max(reserved, min(len(parent.pending_children), self.max_running - seats_of_others))

    def reserve(self, kv: KVCacheManager, request: Request, num_computed: int) -> int:
        """Blocks to keep free when admitting ``request`` with ``num_computed`` tokens
        allocated now: the rest of its known tokens, plus the headroom."""
        rest = kv.max_live_blocks(request.num_tokens) - kv.num_blocks_for(num_computed)
        return self.headroom_blocks + max(0, rest)
