"""What a KV cache manager is built from: ``KVCacheConfig`` (and the window of a windowed one).

The engine derives it from ``EngineConfig`` and the memory plan; ``create_kv_cache_manager``
(``core/managers.py``) picks the manager class from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.kv.kv_groups import KVGroupSpec


@dataclass(frozen=True, slots=True)
class KVWindow:
    """The window of a windowed engine: the last ``window`` tokens plus the first sinks."""

    window: int
    num_sink_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"kv_window must be a positive int, got {self.window!r}")
        if not isinstance(self.num_sink_tokens, int) or self.num_sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens must be an int >= 0, got {self.num_sink_tokens!r}")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The KV cache manager's configuration.

    ``kind`` picks the class: "windowed" when ``kv_window`` is set, else ``allocator``
    ("paged": blocks on demand with prefix sharing; "contiguous": one run per request).
    ``max_model_len`` is needed by the contiguous allocator (its reservation);
    ``max_num_batched_tokens`` (the step's token budget, the largest chunk a request is given
    in one step) by the windowed one, to bound the blocks a request holds at once.
    """

    num_blocks: int
    block_size: int
    allocator: str = "paged"
    enable_prefix_caching: bool = True
    enable_host_prefix_cache: bool = False
    num_host_blocks: int = 0
    kv_window: KVWindow | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    # A hybrid model's KV cache groups (``kv_groups.py``): the "hybrid" manager.
    kv_groups: tuple[KVGroupSpec, ...] | None = None

    @property
    def kind(self) -> str:
        """The manager variant: "hybrid", "windowed", "paged" or "contiguous"."""
        if self.kv_groups:
            return "hybrid"
        return "windowed" if self.kv_window is not None else self.allocator


def check_cache_options(
    owner: str,
    conflict: str | None,
    *,
    enable_prefix_caching: bool,
    enable_host_prefix_cache: bool,
    num_host_blocks: int,
) -> None:
    """ValueError naming the conflict among a manager's caching options.

    ``owner`` is the manager class's name, ``conflict`` its ``prefix_caching_conflict`` (why
    it cannot cache prefixes, or None).
    """
    if enable_prefix_caching and conflict is not None:
        raise ValueError(f"{owner} needs enable_prefix_caching=False: {conflict}")
    if enable_host_prefix_cache and not enable_prefix_caching:
        raise ValueError("enable_host_prefix_cache needs enable_prefix_caching")
    if enable_host_prefix_cache and num_host_blocks == 0:
        raise ValueError(
            "enable_host_prefix_cache needs a host tier: num_host_blocks (swap_space) is 0"
        )
