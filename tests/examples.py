"""How many examples a property-based test draws.

The suite runs each property at the count its test names, sized so that the whole suite stays
within its CI budget (15 minutes on 2 cores). ``KVSERVE_EXAMPLES_SCALE`` multiplies every such
count: ``make fuzz`` runs the properties 4x deeper.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("KVSERVE_EXAMPLES_SCALE", "1"))


def examples(count: int) -> int:
    """``count`` times the scale set for this run, at least 1."""
    return max(1, round(count * SCALE))
