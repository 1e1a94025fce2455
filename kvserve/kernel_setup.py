"""Start-up choice of the model dtype (``--dtype auto``) and of the projection kernels.

``resolve_dtype(config, arch)`` turns ``config.dtype`` into a torch dtype: on CUDA ``auto`` is
bfloat16 (float16 without bf16 support); on CPU it is bfloat16 only where the CPU has native
bf16 arithmetic (AMX or AVX512_BF16) *and* a decode step's matmuls (each dtype with its
chosen kernels, timed in alternation: ``dtype_speedup``) run faster in bf16; else float32.
An explicit ``bfloat16`` on a CPU without native bf16 runs, with a warning giving the
measured slowdown.

``select_model_kernels(config, arch, dtype)`` measures (or reads from the cache) the fastest
``LinearMethod`` per projection shape and M bucket (``kvserve.runtime.kernel_select``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import ModelArchConfig
from kvserve.engine_config import EngineConfig
from kvserve.runtime.kernel_select import (
    DECODE_BOUNDS,
    Selection,
    cache_path,
    cpu_flags,
    cpu_identity,
    machine_load,
    select_kernels,
)
from kvserve.runtime.linear import Linear, build_linear

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
            slow = 1.0 / dtype_speedup(arch, fp32, bf16, device=device, mode=mode)
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
    ratio = dtype_speedup(arch, fp32, bf16, device=device, mode=probe)
    dtype, sel = (torch.bfloat16, bf16) if ratio > 1.0 else (torch.float32, fp32)
    if mode == "off":
        sel = select_shapes(config, arch, dtype, "off")
    reason = f"auto: native bf16, decode matmuls bf16 {ratio:.2f}x fp32 speed"
    return KernelChoice(dtype, sel, reason)


def dtype_speedup(
    arch: ModelArchConfig,
    fp32: Selection,
    bf16: Selection,
    *,
    device: torch.device,
    mode: str = "auto",
    timer: Callable[[Linear, torch.Tensor, torch.Tensor], float] | None = None,
    budget_s: float = 0.010,
    passes: int = 2,
) -> float:
    """fp32 time / bf16 time of a decode step's matmuls (M = 1, 8, 32; each dtype with its
    chosen kernels), cached like the selections (``mode`` "measure": measured again).

    NOTE: the two dtypes are timed in alternation in one run, never taken from two selections
    measured at different times: on a shared machine those can be minutes and loads apart.
    """
    counts = projection_shapes(arch)
    model, flags = cpu_identity()
    key = {
        "what": "dtype_speedup",
        "version": 1,
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
        "shapes": sorted([*s, n] for s, n in counts.items()),
        "plans": [repr(sorted(fp32.plan.items())), repr(sorted(bf16.plan.items()))],
    }
    path = cache_path(key).with_name("dtype_" + cache_path(key).name)
    load = machine_load()
    if mode != "measure" and path.exists():
        try:
            record = json.loads(path.read_text())
            if record["key"] == key and not (record["load"] > 1.0 and load < record["load"] / 2):
                return float(record["speedup"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("dtype cache %s is corrupt (%s): measuring again", path, e)
    time_call = timer or _time_linear
    gen = torch.Generator().manual_seed(2)
    cells = []  # (count, [(linear, x, out) for fp32, bf16])
    for shape, n in counts.items():
        w = torch.randn(shape[1], shape[0], generator=gen).t() * 0.02  # the model's layout
        pair = []
        for dt, sel in ((torch.float32, fp32), (torch.bfloat16, bf16)):
            choice = sel.plan.get(shape) if sel.source != "off" else None
            pair.append(build_linear(w.to(dt), act_dtype=dt, device=device, choice=choice))
        for m in _DECIDING_BOUNDS:
            x = torch.randn(m, shape[1], generator=gen)
            cells.append(
                (
                    n,
                    [
                        (
                            lin,
                            x.to(lin.source.dtype),
                            x.new_empty(m, shape[0], dtype=lin.source.dtype),
                        )
                        for lin in pair
                    ],
                )
            )
    best = [[float("inf"), float("inf")] for _ in cells]
    for _ in range(passes):
        for i, (_n, items) in enumerate(cells):
            spent = [0.0, 0.0]
            for round_ in range(200):
                for j, (lin, x, out) in enumerate(items):
                    dt = time_call(lin, x, out)
                    best[i][j] = min(best[i][j], dt)
                    spent[j] += dt
                if round_ >= 4 and min(spent) >= budget_s:
                    break
    t32 = sum(n * b[0] for (n, _), b in zip(cells, best, strict=True))
    t16 = sum(n * b[1] for (n, _), b in zip(cells, best, strict=True))
    speedup = t32 / t16 if t16 > 0 else float("inf")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "speedup": speedup, "load": load}))
    except OSError as e:
        log.warning("dtype cache %s not written: %s", path, e)
    return speedup


def _time_linear(lin: Linear, x: torch.Tensor, out: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    t = time.perf_counter()
    lin(x, out)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t
