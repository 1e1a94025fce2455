"""Paged attention in Triton kernels (``TritonBackend``), one kernel to a file.

- ``kv_write.py``: the K/V write (quantizing for an int8 / fp8 cache);
- ``paged_attention.py``: decodes and prefill chunks of a step in one launch, GQA, windows
  with sinks, int8 / fp8 KV dequantised in the kernel, split-K;
- ``split_reduce.py``: the split-K merge;
- ``quant.py``: the device functions that (de)quantize as ``kv_cache.py`` does;
- ``plan.py``: the step's launch plan (host side, no triton);
- ``backend.py``: the backend that launches them.

The kernels run on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests' path:
slow, exact). Only ``unavailable_reason`` is imported here: the kernel modules import triton,
which this checks for first.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: str | torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (None when it can).

    NOTE: triton decides at import of a kernel module whether kernels compile or are
    interpreted, so ``TRITON_INTERPRET=1`` must be set before the backend is first built.
    """
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    dev = torch.device(device)
    if dev.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET=1 runs kernels on CPU tensors only; unset it on CUDA"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if dev.type == "cpu":
        if interpreting():
            return _imported_compiled()
        return "on CPU Triton kernels run only under its interpreter (set TRITON_INTERPRET=1)"
    return f"device type {dev.type!r} is not supported (CUDA, or CPU with TRITON_INTERPRET=1)"


def _imported_compiled() -> str | None:
    """Why interpreted kernels cannot run: triton was imported before TRITON_INTERPRET=1."""
    lang = sys.modules.get("triton.language")
    if lang is None:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(lang.zeros, InterpretedFunction):
        return None
    return "triton was imported before TRITON_INTERPRET=1 was set; set it before the first import"
