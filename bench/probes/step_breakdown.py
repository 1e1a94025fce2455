"""Where a bare decode step's time goes: each part timed by wrapping its Python call.

    PYTHONPATH=. .venv/bin/python bench/probes/step_breakdown.py [runtime_speed flags]
    # e.g. --batch-sizes 1 8 --steps 128 --repeats 3

Runs ``kvserve.bench.runtime_speed`` with its decode loop instrumented: every projection
(``Linear.__call__``), decode attention (the backend's ``forward``), the layer ops (norms,
RoPE, SiLU x up), the model forward, ``prepare_inputs``, ``compute_logits`` and the sampler
are timed with ``time.perf_counter`` around the call (the ops run synchronously on the
calling thread, so the clock sees their whole time). A step that runs every layer in one
native call (``kvserve/models/fused_layers.py``) shows it as "fused layers" instead of the
per-layer parts; ``KVSERVE_FUSED_LAYERS=0`` shows those parts. Printed per decode run: ms a step for
each part, and "glue", the step's time that no timed call covers (Python between the calls,
tensor views, the runner's bookkeeping). A wrapper costs ~0.3 us, ~150 calls a step.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvserve.bench import runtime_speed
from kvserve.models import llama
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runtime import attention, layer_ops, model_runner
from kvserve.runtime.linear import Linear
from kvserve.runtime.native import backend as native_backend
from kvserve.runtime.native.backend import NativeCPUBackend

TOTALS: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t

    return wrapper


def _instrument() -> None:
    Linear.__call__ = _timed("projections", Linear.__call__)  # type: ignore[method-assign]
    for cls in (attention.TorchReferenceBackend, attention.TorchSDPABackend, NativeCPUBackend):
        if "forward" in vars(cls):
            cls.forward = _timed("attention", cls.forward)  # type: ignore[method-assign]
    real_ops = native_backend.native.ops

    class _TimedOps:
        def __init__(self, ops: Any) -> None:
            self._ops = ops

        def __getattr__(self, name: str) -> Any:
            return _timed(f"attention: {name}", getattr(self._ops, name))

    native_backend.native.ops = lambda: _TimedOps(real_ops())  # type: ignore[assignment]
    ops = layer_ops.NativeLayerOps
    for name in ("add_rms_norm", "rope_", "silu_mul"):
        setattr(ops, name, _timed("layer ops", getattr(ops, name)))
    llama.run_fused_layers = _timed("fused layers (one native call)", llama.run_fused_layers)
    runner = model_runner.ModelRunner
    runner.prepare_inputs = _timed("prepare_inputs", runner.prepare_inputs)  # type: ignore[method-assign]
    model_runner.sample_guarded = _timed("sampler", model_runner.sample_guarded)
    LlamaForCausalLM.forward = _timed("forward (all)", LlamaForCausalLM.forward)  # type: ignore[method-assign]
    LlamaForCausalLM.compute_logits = _timed(  # type: ignore[method-assign]
        "compute_logits (lm_head)", LlamaForCausalLM.compute_logits
    )
    decode = runtime_speed._decode
    run_batch = runtime_speed.run_batch

    def run_batch_timed(*args: Any, **kwargs: Any) -> Any:
        TOTALS.clear()
        TOTALS["start"] = time.perf_counter()
        return run_batch(*args, **kwargs)

    def decode_and_report(runner_: Any, prefilled: Any, tables: Any, steps: int) -> Any:
        if "start" in TOTALS:  # the prefill of this run_batch
            _report(f"prefill of B={len(prefilled)}", time.perf_counter() - TOTALS.pop("start"), 1)
        TOTALS.clear()
        wall, cpu = decode(runner_, prefilled, tables, steps)
        _report(f"decode B={len(prefilled)}", wall, steps - 1)
        return wall, cpu

    runtime_speed._decode = decode_and_report
    runtime_speed.run_batch = run_batch_timed


def _report(what: str, wall: float, n: int) -> None:
    """Print ms a step of each part of ``wall`` seconds over ``n`` steps (TOTALS)."""
    inner = ("projections", "attention", "layer ops", "fused layers (one native call)")
    lm_head = TOTALS["compute_logits (lm_head)"]
    forward_glue = TOTALS["forward (all)"] + lm_head - sum(TOTALS[k] for k in inner)
    parts = {k: TOTALS[k] for k in TOTALS if k != "forward (all)"}
    # NOTE: the lm_head's Linear call is in compute_logits, not in the forward's parts.
    parts["projections"] -= TOTALS["compute_logits (lm_head)"]
    parts["forward glue (views, embed, rope tables, adds)"] = forward_glue
    outer = TOTALS["forward (all)"] + sum(
        TOTALS[k] for k in ("prepare_inputs", "compute_logits (lm_head)", "sampler")
    )
    parts["runner glue (outside the timed calls)"] = wall - outer
    print(f"{what}: {1e3 * wall / n:.2f} ms a step over {n} steps")
    for k, v in parts.items():
        print(f"  {k:48s} {1e3 * v / n:7.3f} ms")


if __name__ == "__main__":
    _instrument()
    runtime_speed.main(sys.argv[1:])
