"""Kernel selection ("autotune"): the model dtype and, per projection shape and M bucket, the
``LinearMethod`` that runs it, chosen once per start-up by measurement on this machine.

One entry point: ``choose_kernels(settings, arch, quantized) -> KernelChoice``. Start-up
(``kvserve.engine.startup``) builds the ``TuneSettings`` from its ``EngineConfig``, calls it
once before the weights are read for a dense model, or, for one whose weights load quantized,
once for the pending choice (nothing measured) and once after the load with the model's
``QuantizedProjections``; it hands ``KernelChoice.plan`` to the model and prints
``KernelChoice.summary()`` in its one start-up line. Per-shape, per-candidate and per-plan
detail is logged at debug level only.

The flow, per dtype and kind of weight (``select``):

1. **candidates** (``candidates``): the kernels the registered factories can build for a
   weight of each shape (dense ``torch.mm`` and oneDNN, AMX, the quantized kernels), the M
   buckets, the dtypes this CPU runs natively.
2. **measure** (``measure``): every candidate timed per shape and bucket on cold copies of
   random weights, interleaved; ``measure_dtype`` times a decode step in fp32 against bf16.
3. **choose** (``choose``): the fastest per bucket (a candidate holding a copy must win by a
   margin); ``tune`` picks the dtype from the measured speed-up.
4. **check** (``check``): the decode buckets' choices against their near alternatives, timed
   as whole steps' projections run; the fastest plan replaces the per-shape one.
5. **cache** (``cache``): the outcome written as a JSON record keyed by all it depends on
   (CPU, flags, torch, threads, dtype, shapes, candidates, the kernels' builds), under a
   directory per checkout; a later start-up reads it instead of measuring.

Modes (``--kernel-selection``): ``auto`` (the cache, else measure), ``measure`` (always
measure, then refresh the cache), ``off`` (no measurement: ``torch.mm`` everywhere).
"""

from kvserve.runtime.autotune.candidates import (
    DTYPE_CHOICES,
    DTYPES,
    SELECTION_MODES,
    QuantizedProjections,
)
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.autotune.tune import KernelChoice, TuneSettings, choose_kernels

__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "SELECTION_MODES",
    "KernelChoice",
    "QuantizedProjections",
    "Selection",
    "TuneSettings",
    "choose_kernels",
]
