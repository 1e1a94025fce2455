"""Cache: the on-disk record of each start-up measurement, what it depends on, where it is
kept, and when a kept one is measured again.

The kernel selections (``select.select_kernels``, ``select.quantized_selection``), the dtype
decision (``measure_dtype.dtype_speedup``) and the chunk-attention limit
(``native.chunk_limit``) each keep a JSON record under
``$KVSERVE_CACHE_DIR/kernel_select/<checkout>/`` (default ``~/.cache/kvserve``), at a path
hashed from its key: everything the measurement depends on (``cache_key``: CPU model and
flags, torch version, threads, device, dtype, shapes, buckets, candidates, the native
kernels' build target). ``<checkout>`` is a hash of the resolved ``kvserve`` package
directory (``checkout_tag``), so two checkouts never overwrite or invalidate each other's
records. A record that cannot be read is ignored with a warning and measured again; one
measured on a busy machine (1-minute load above 1 per CPU) is measured again by a later
start-up that finds the machine at least twice as quiet (``measured_under_load``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvserve.cache_dir import cache_root
from kvserve.runtime.autotune.candidates import cpu_identity
from kvserve.runtime.autotune.choose import Selection
from kvserve.runtime.autotune.measure import Timing
from kvserve.runtime.linear import M_MAX, dtype_tag

log = logging.getLogger(__name__)

# The ``kvserve`` package directory whose records these are (see ``checkout_tag``).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# Bumped when the measurement changes: older choices are redone (8: the step check; 9: the
# copies made before the timing; 10: slow candidates sit out; 11: oneDNN runs one row as two,
# the invariance probe checks 32 single rows).
CACHE_VERSION = 11


def cache_key(
    *,
    act_dtype: torch.dtype,
    device: torch.device,
    shapes: Iterable[tuple[int, int]],
    buckets: Sequence[tuple[int, int]],
    max_rows: Mapping[tuple[int, int], int] | None,
    factories: Sequence[Callable[..., object]],
    counts: Mapping[tuple[int, int], int] | None = None,
) -> dict[str, object]:
    """Everything a selection depends on (the cache is valid only while all of it holds);
    ``counts``: the calls a step makes of each shape, when the step check runs on them."""
    model, flags = cpu_identity()
    if device.type == "cuda":
        model = torch.cuda.get_device_name(device)
    rows = max_rows or {}
    return {
        "version": CACHE_VERSION,
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device.type,
        "dtype": dtype_tag(act_dtype),
        "shapes": sorted([list(s) + [rows.get(s, M_MAX)] for s in shapes]),
        "buckets": [list(b) for b in buckets],
        # NOTE: sorted: the registration order follows the import order, not the selection.
        "candidates": sorted(f"{f.__module__}.{f.__qualname__}" for f in factories),
        "onednn": bool(torch.backends.mkldnn.is_available()),
        # NOTE: the native kernels' build target decides which of them can run (an older
        # kind's build caps the quantized kernels' instruction set: target_has).
        "native_march": _native_march(),
        "step_counts": sorted([*s, n] for s, n in counts.items()) if counts else None,
    }


def _native_march() -> str:
    """The native kernels' -march target ("invalid" for a bad $KVSERVE_NATIVE_MARCH, which
    the kernels' loader reports on its own)."""
    from kvserve.runtime import native

    try:
        return native.march()
    except ValueError:
        return "invalid"


def checkout_tag(package_root: Path | None = None) -> str:
    """A short hash of the resolved ``kvserve`` package directory (default: this one's).

    NOTE: the cache is per checkout: two checkouts (git worktrees, a release beside a
    development tree) may hold other kernels under the same key, and shared records made
    each one measure again after the other (or run the other's choice).
    """
    root = (package_root or PACKAGE_ROOT).resolve()
    return hashlib.sha256(str(root).encode()).hexdigest()[:12]


def cache_dir(package_root: Path | None = None) -> Path:
    """Where selections are cached: ``$KVSERVE_CACHE_DIR/kernel_select/<checkout_tag>``."""
    return cache_root() / "kernel_select" / checkout_tag(package_root)


def cache_path(key: Mapping[str, object], directory: Path | None = None) -> Path:
    """The cache file of ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (directory or cache_dir()) / f"{digest}.json"


def read_cached_value(path: Path, key: Mapping[str, object], field: str, what: str) -> Any:
    """``record[field]`` of the JSON record for ``key`` at ``path``; None when absent, written
    for another key, corrupt (warned, naming ``what``) or measured under load on a machine
    that is quieter now (measured again, like the selections)."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if record["key"] != json.loads(json.dumps(key)):
            return None
        if measured_under_load(record["load"], machine_load()):
            return None
        return record[field]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s cache %s is corrupt (%s): measuring again", what, path, e)
        return None


def write_cached_value(
    path: Path, key: Mapping[str, object], field: str, value: object, load: float, what: str
) -> None:
    """Write ``{key, field: value, load}`` to ``path`` (``write_record``)."""
    write_record(path, {"key": key, field: value, "load": load}, what)


def measured_under_load(cached_load: float, load: float) -> bool:
    """Whether a cached measurement taken at ``cached_load`` (per CPU) is to be taken again
    now, at ``load``: it was taken on a busy machine (above 1 per CPU) and this one is at
    least twice as quiet, so a noisy choice does not stick."""
    return cached_load > 1.0 and load < cached_load / 2


def machine_load() -> float:
    """1-minute load average per CPU (0.0 where unknown): above 1, timings are disturbed."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return 0.0


def read_record(path: Path, key: Mapping[str, object], what: str) -> dict | None:
    """The JSON record for ``key`` at ``path``; None when absent, or unreadable or written for
    another key (warned as corrupt, naming ``what``)."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if record["key"] != json.loads(json.dumps(key)):
            raise ValueError("key mismatch")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s cache %s is corrupt (%s): ignored, measuring again", what, path, e)
        return None
    return record


def write_record(path: Path, record: Mapping[str, object], what: str) -> None:
    """Write ``record`` to ``path`` atomically (a torn write never leaves a half file); a
    failure is warned, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("%s cache %s not written: %s", what, path, e)


def load_cached(path: Path, key: Mapping[str, object], act_dtype: torch.dtype) -> Selection | None:
    """The selection cached for ``key`` at ``path`` (source "cache", ``load`` as measured),
    or None (absent; unreadable: warned)."""
    record = read_record(path, key, "kernel selection")
    if record is None:
        return None
    try:
        plan = {
            (int(o), int(i)): [(int(b), str(n)) for b, n in choice]
            for o, i, choice in record["plan"]
        }
        timings = [Timing(**t) for t in record["timings"]]
    except (ValueError, KeyError, TypeError) as e:
        log.warning("kernel selection cache %s is corrupt (%s): ignored, measuring again", path, e)
        return None
    return Selection(
        act_dtype,
        plan,
        timings,
        dict(record.get("skipped", {})),
        "cache",
        load=float(record.get("load", 0.0)),
        checks=list(record.get("checks", [])),
    )


def save_cached(path: Path, key: Mapping[str, object], sel: Selection) -> None:
    """Write ``sel`` for ``key`` (atomically: a torn write never leaves a half file)."""
    record = {
        "key": key,
        "plan": [[o, i, [list(c) for c in choice]] for (o, i), choice in sel.plan.items()],
        "timings": [asdict(t) for t in sel.timings],
        "skipped": sel.skipped,
        "load": sel.load,
        "checks": sel.checks,
    }
    write_record(path, record, "kernel selection")
