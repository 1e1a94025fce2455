"""Start-up choice of the model dtype (``--dtype auto``) and of the projection kernels.

``resolve_dtype(config, arch)`` turns ``config.dtype`` into a torch dtype: on CUDA ``auto`` is
bfloat16 (float16 without bf16 support); on CPU it is bfloat16 only where the CPU has native
bf16 arithmetic (AMX or AVX512_BF16) *and* the kernel measurement says a decode step's
matmuls run faster in bf16 than in fp32; else float32. An explicit ``bfloat16`` on a CPU
without native bf16 runs, with a warning giving the measured slowdown.

``select_model_kernels(config, arch, dtype)`` measures (or reads from the cache) the fastest
``LinearMethod`` per projection shape and M bucket (``kvserve.runtime.kernel_select``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.engine_config import EngineConfig
from kvserve.runtime.kernel_select import DECODE_BOUNDS, Selection, cpu_flags, select_kernels

log = logging.getLogger("kvserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# The decode buckets whose matmul time decides ``auto`` (B=1 .. 32 decoding).
_DECIDING_BOUNDS = (1, 8, 32)


def projection_shapes(arch: ModelArchConfig) -> dict[tuple[int, int], int]:
    """(out, in) of every projection weight -> how many a decode step runs (layers; lm_head 1)."""
    h, d = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * d
    kv = arch.num_key_value_heads * d
    counts: dict[tuple[int, int], int] = {}
    for shape in (
        (q + 2 * kv, h),
        (h, q),
        (2 * arch.intermediate_size, h),
        (h, arch.intermediate_size),
    ):
        counts[shape] = counts.get(shape, 0) + arch.num_hidden_layers
    head = (arch.vocab_size, h)
    counts[head] = counts.get(head, 0) + 1
    return counts


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AMX-BF16 or AVX512_BF16)."""
    flags = set(cpu_flags().split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


@dataclass(frozen=True)
class KernelChoice:
    """The dtype chosen and the kernel selection for it (plus a line saying why)."""

    dtype: torch.dtype
    selection: Selection
    reason: str

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def short(self) -> str:
        """The dtype (and why) and where the kernel choice came from, in a few words."""
        how = {"off": "selection off", "cache": "from cache"}.get(self.selection.source, "measured")
        return f"dtype {self.dtype_name} ({self.reason}); kernels {how}"

    def summary(self) -> str:
        """The start-up line: dtype (and why), then the kernels."""
        return f"dtype {self.dtype_name} ({self.reason}); {self.selection.summary()}"


def select_shapes(
    config: EngineConfig, arch: ModelArchConfig, dtype: torch.dtype, mode: str
) -> Selection:
    counts = projection_shapes(arch)
    return select_kernels(
        counts,
        act_dtype=dtype,
        device=config.device,
        mode=mode,
        # NOTE: the lm_head runs on the sampled rows only: measured up to the decode sizes.
        max_rows={(arch.vocab_size, arch.hidden_size): DECODE_BOUNDS[-1]},
    )


def decode_matmul_seconds(sel: Selection, arch: ModelArchConfig) -> float:
    """Measured matmul seconds of decode steps at M = 1, 8 and 32 (summed), chosen kernels."""
    return sel.total_seconds(_DECIDING_BOUNDS, projection_shapes(arch))


def choose_dtype_and_kernels(config: EngineConfig, arch: ModelArchConfig) -> KernelChoice:
    """Resolve ``config.dtype`` (see the module docstring) and select the kernels for it."""
    device = torch.device(config.device)
    mode = config.kernel_selection
    if config.dtype != "auto":
        dtype = DTYPES[config.dtype]
        if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
            fp32 = select_shapes(config, arch, torch.float32, "auto" if mode == "off" else mode)
            bf16 = select_shapes(config, arch, dtype, "auto" if mode == "off" else mode)
            slow = decode_matmul_seconds(bf16, arch) / max(decode_matmul_seconds(fp32, arch), 1e-12)
            log.warning(
                "dtype bfloat16 on a CPU without native bf16 (no AMX / AVX512_BF16): decode "
                "matmuls measured %.2fx the time of float32",
                slow,
            )
        return KernelChoice(dtype, select_shapes(config, arch, dtype, mode), "requested")
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return KernelChoice(dtype, select_shapes(config, arch, dtype, mode), "auto: CUDA")
    if not native_bf16():
        return KernelChoice(
            torch.float32, select_shapes(config, arch, torch.float32, mode), "auto: no native bf16"
        )
    # NOTE: the decision needs timings even with selection off: measure (or read the cache)
    # for the decision, then use the requested mode's selection for the chosen dtype.
    probe = "auto" if mode == "off" else mode
    fp32 = select_shapes(config, arch, torch.float32, probe)
    bf16 = select_shapes(config, arch, torch.bfloat16, probe)
    t32, t16 = decode_matmul_seconds(fp32, arch), decode_matmul_seconds(bf16, arch)
    dtype, sel = (torch.bfloat16, bf16) if t16 < t32 else (torch.float32, fp32)
    if mode == "off":
        sel = select_shapes(config, arch, dtype, "off")
    ratio = t32 / t16 if t16 > 0 else float("inf")
    reason = f"auto: native bf16, decode matmuls bf16 {ratio:.2f}x fp32 speed"
    return KernelChoice(dtype, sel, reason)
