"""The per-token side of ``Scheduler.update_from_output``: append a sampled token, stop checks.

Functions of the request and the limits passed in; the scheduler finishes a request these
say is done (``Scheduler._finish`` frees its blocks in the same step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv.kv_cache_manager import KVCacheManager


def append_token(request: Request, token_id: int, now: float) -> None:
    """Append a sampled token and stamp the first/last token times with ``now``."""
    request.output_token_ids.append(token_id)
    if request.first_token_time is None:
        request.first_token_time = now
    request.last_token_time = now


def is_stop_token(request: Request, token_id: int) -> bool:
    """Whether ``token_id`` ends ``request`` (once it has ``min_tokens``): EOS unless
    ``ignore_eos``, or one of its ``stop_token_ids``."""
    params = request.sampling_params
    if token_id == request.eos_token_id and not params.ignore_eos:
        return True
    return bool(params.stop_token_ids) and token_id in params.stop_token_ids


def check_stop(
    request: Request, token_id: int, *, max_model_len: int, kv: KVCacheManager
) -> RequestStatus | None:
    """Stop checks after appending ``token_id``; sets ``stop_reason`` for stop tokens.

    EOS (unless ignore_eos) and stop_token_ids count only once min_tokens tokens exist;
    then max_tokens, max_model_len, and a next token whose KV would need more blocks at
    once than the whole pool (a request growing without max_tokens; ``max_live_blocks``)
    finish with "length".
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens and is_stop_token(request, token_id):
        if params.ignore_eos or token_id != request.eos_token_id:
            request.stop_reason = token_id  # one of stop_token_ids (EOS has no reason)
        return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    if kv.max_live_blocks(request.num_tokens) > kv.num_blocks:
        return RequestStatus.FINISHED_LENGTH
    return None
