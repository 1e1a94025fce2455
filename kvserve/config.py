"""Engine configuration: frozen dataclasses, validated at construction (ValueError)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

# Weight quantization modes (vLLM's --quantization): kept torch-free here so the engine's
# config and the models' loader share one list.
QUANTIZATION_CHOICES = ("auto", "none", "q8_0", "q4_0", "q4_1")

# HF's per-layer attention types (``ModelArchConfig.layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Activations of the gated MLP: SwiGLU, and GeGLU with the tanh approximation.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
KVCacheDType = Literal["auto", "int8", "fp8"]
DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes of a Llama-family model, from GGUF metadata or an HF config.json.

    One decoder serves every family; the fields say where they differ: q/k/v biases
    (``attention_bias``: Qwen2), per-head q/k RMSNorm before RoPE (``qk_norm``: Qwen3), the
    RoPE variant (``rope_scaling``), a sliding window (Mistral, Phi-3). Phi-3's fused
    ``qkv_proj`` / ``gate_up_proj`` tensors are split by the loaders. A mixture of experts
    (Mixtral, Qwen2-MoE, Qwen3-MoE) replaces the MLP of the layers ``is_moe_layer`` names
    with ``num_experts`` routed experts (``models/moe.py``).

    Gemma 2 / 3 add: sliding and full layers (``layer_types``), a RoPE base of the sliding
    layers (``local_rope_theta``), attention and final logit soft-capping, an attention
    scale of ``query_pre_attn_scalar ** -0.5``, norms after attention and after the MLP
    (``sandwich_norms``), RMSNorm weights applied as ``1 + w`` (``norm_weight_offset``),
    GeGLU (``hidden_act``) and the embedding scaled by ``sqrt(hidden_size)``.
    """

    # "llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2moe", "qwen3moe",
    # "gemma2", "gemma3"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm over each q / k head (head_dim weights) before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of experts; 0 experts: every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # qwen2moe: a sigmoid-gated shared expert
    decoder_sparse_step: int = 1  # layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (a dense MLP)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs routed experts instead of a dense MLP (as
        transformers' Qwen2-MoE / Qwen3-MoE decide it; Mixtral: every layer)."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer not in self.mlp_only_layers
        )

    # Per layer "sliding_attention" (``sliding_window`` applies) or "full_attention" (HF's
    # values); None: every layer alike (``sliding_window`` applies to all, if set). A mix
    # gets the hybrid KV cache (core/kv/kv_groups.py).
    layer_types: tuple[str, ...] | None = None
    # RoPE base (default RoPE) of the layers typed sliding_attention (Gemma 3); None: rope_theta.
    local_rope_theta: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_dim
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    sandwich_norms: bool = False  # Gemma: RMSNorm of the attention and the MLP outputs too
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm weights applied as (1 + w)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(
                    f"layer_types: unknown type(s) {unknown} (known: {', '.join(LAYER_TYPES)})"
                )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported ({', '.join(HIDDEN_ACTS)})"
            )
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")

    def with_num_layers(self, num_layers: int) -> ModelArchConfig:
        """This config with ``num_layers`` layers (their ``layer_types`` the first ones,
        the pattern repeated past the end)."""
        types = self.layer_types
        if types is not None:
            types = tuple(types[i % len(types)] for i in range(num_layers))
        return dataclasses.replace(self, num_hidden_layers=num_layers, layer_types=types)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: it attends over everything)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def shared_window(self) -> int | None:
        """The window every layer attends within (None where some layer sees everything):
        what a cache uniform over the layers may rely on."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def default_attention_scale(self) -> bool:
        """Whether q . k is scaled by ``head_dim ** -0.5`` (no ``query_pre_attn_scalar``, or
        one equal to ``head_dim``, as most Gemma models have)."""
        return self.query_pre_attn_scalar in (None, self.head_dim)

    @property
    def attention_scale(self) -> float:
        """The factor of q . k: ``query_pre_attn_scalar ** -0.5`` (Gemma), else
        ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes: the seed's formula."""
        return int(
            2
            * self.num_hidden_layers
            * self.num_key_value_heads
            * self.head_dim
            * bytes_per_element
        )


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV pool and its host tier."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for KV blocks; None = derived from the budget
    memory_budget: int | None = None  # total bytes (weights + activations + headroom + KV)
    kv_cache_dtype: KVCacheDType = "auto"
    enable_prefix_caching: bool = True
    swap_space: int | None = None  # bytes of host tier for swap preemption
    num_host_blocks: int | None = None  # exact host tier size; overrides swap_space

    def __post_init__(self) -> None:
        _pos("block_size", self.block_size)
        if self.block_size > 1024:
            raise ValueError("block_size must be <= 1024")
        for name in ("num_kv_blocks", "kv_cache_memory", "memory_budget", "swap_space"):
            v = getattr(self, name)
            if v is not None:
                _pos(name, v)
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits and admission / preemption policy."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192  # resolved against the model at start-up
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    # Admission keeps this fraction of the pool free (headroom for running decodes)...
    admission_headroom: float = 0.02
    # ...and after a preemption stays closed until this fraction is free (hysteresis).
    resume_watermark: float = 0.10
    # "priority": a waiting request preempts less important running ones (see Scheduler).
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Seats one n > 1 request's samples take at once while others wait; None: max_running // 2.
    max_seats_per_request: int | None = None
    # Async scheduling (vLLM's ``async_scheduling``): schedule() may run while the previous
    # step's forward is in flight, counting one placeholder token per sampling request.
    async_scheduling: bool = False
    # Fair prefill (core/sched/fair_prefill.py): while several requests want prefill tokens,
    # one request's chunk takes at most this share of what the decodes left first; 1.0: off.
    prefill_share: float = 0.5

    def __post_init__(self) -> None:
        _pos("max_num_seqs", self.max_num_seqs)
        _pos("max_num_batched_tokens", self.max_num_batched_tokens)
        _pos("max_model_len", self.max_model_len)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not 0 <= self.admission_headroom < 1:
            raise ValueError("admission_headroom must be in [0, 1)")
        if not self.admission_headroom <= self.resume_watermark < 1:
            raise ValueError("resume_watermark must be in [admission_headroom, 1)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.max_seats_per_request is not None:
            _pos("max_seats_per_request", self.max_seats_per_request)
        ps = self.prefill_share
        if isinstance(ps, bool) or not isinstance(ps, (int, float)) or not 0.0 < ps <= 1.0:
            raise ValueError(
                f"prefill_share (--prefill-share) must be a number in (0, 1] (1: off), got {ps!r}"
            )

    @property
    def max_running(self) -> int:
        """Seats: requests (samples) running at once, ``max_num_seqs`` capped at the token
        budget.

        NOTE: every running request needs a token of a step's budget to move; with more
        seats than budget tokens the requests past the budget held their KV blocks for
        whole stretches of steps without progress (n > 1 forks filled the seats).
        """
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def seat_share(self) -> int:
        """Seats the samples of one request take at once while others wait."""
        if self.max_seats_per_request is not None:
            return min(self.max_seats_per_request, self.max_running)
        return max(1, self.max_running // 2)


def _pos(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
