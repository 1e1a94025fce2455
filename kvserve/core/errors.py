"""``IntegrityError``: a broken invariant of the memory core.

Every ``check_integrity()`` in the core raises it, naming the first broken invariant. It is
raised explicitly (never with ``assert``), so the checks also run under ``python -O`` and
``/debug/integrity`` cannot report a false ok. It subclasses ``AssertionError`` so callers
that catch that (tests, tools written before it existed) still see it.
"""

from __future__ import annotations


class IntegrityError(AssertionError):
    """A broken invariant of the memory core (the message names it)."""
