"""The activation plan kept on disk across start-ups (``$KVSERVE_CACHE_DIR/activation_plans``).

Tracing the worst-case steps under fake tensors costs a warm start a few seconds, over half of
it importing ``torch._dynamo`` (which ``FakeTensorMode`` pulls in). The plan is a pure function
of the arguments, the package's code, torch's version and the CPU's feature flags, so a start
with all of them unchanged reads it back instead of tracing again. ``KVSERVE_PLAN_CACHE=0``
turns the disk cache off (the test suite does, so its tests trace).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvserve.cache_dir import cache_root, source_digest
from kvserve.runtime.autotune.candidates import cpu_flags

logger = logging.getLogger(__name__)
T = TypeVar("T")
CACHE_VERSION = 1
DISABLE_ENV = "KVSERVE_PLAN_CACHE"


def plan_key(args: tuple[Any, ...]) -> str:
    """A file-name-safe key over ``args`` (their reprs) and what else decides the plan.

    NOTE: callables are named by module and qualified name: their code is in the digest. An
    "auto" attention backend resolves by whether the native kernels load, so that is in too.
    """
    from kvserve.runtime import native  # NOTE: loaded by now at start-up; cached after

    named = [
        f"{a.__module__}.{a.__qualname__}" if callable(a) and hasattr(a, "__qualname__") else a
        for a in args
    ]
    loaded = native.load()
    whole = repr((CACHE_VERSION, named, torch.__version__, source_digest(), cpu_flags(), loaded))
    return hashlib.sha256(whole.encode()).hexdigest()[:24]


def cached_on_disk(key: str, compute: Callable[[], T]) -> T:
    """``compute()``'s result as stored under ``key``, computing and storing it on a miss.

    A file that cannot be read or written costs a recompute, never a failed start-up.
    """
    if os.environ.get(DISABLE_ENV) == "0":
        return compute()
    path = plan_cache_dir() / f"{key}.pkl"
    try:
        with open(path, "rb") as f:
            # NOTE: a file this package wrote into the user's own cache folder, as trusted as
            # the native library loaded from beside it.
            return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as e:  # a truncated or stale file: plan again and overwrite it
        logger.debug("activation plan cache %s unreadable (%s); planning again", path, e)
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            pickle.dump(value, f)
        os.replace(f.name, path)
    except OSError as e:
        logger.debug("activation plan not cached at %s: %s", path, e)
    return value


def plan_cache_dir() -> Path:
    """Where the plans live (for tests and ``kvserve bench memory``)."""
    return cache_root() / "activation_plans"
