"""Where kvserve keeps what it computes once per machine: native builds, converted tokenizers,
kernel choices and activation plans (``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``).

Torch-free, so ``core/``-level code and the tokenizer can use it.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

CACHE_ENV = "KVSERVE_CACHE_DIR"
PACKAGE_DIR = Path(__file__).resolve().parent


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``~/.cache/kvserve`` (read at each call: tests set it)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvserve")


@cache
def source_digest(package: Path = PACKAGE_DIR) -> str:
    """A hash of every ``.py`` file of the package: a cached result derived from the code (an
    activation plan, say) is keyed by it, so any edit invalidates it. ~10 ms, once a process."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]
