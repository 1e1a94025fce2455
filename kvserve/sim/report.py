"""Text output of the simulator: the KV header every run prints, and plain-text tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.sim.hardware import GB, GiB
from kvserve.sim.specs import ModelSpec

Cell = str | int | float | None


def kv_header_lines(model: ModelSpec, context_len: int = 8192, batch_size: int = 128) -> list[str]:
    """KV bytes per token, per request and per batch at ``context_len`` (in GB and GiB)."""
    per_token = model.kv_bytes_per_token
    one = model.kv_bytes(context_len)
    batch = model.kv_bytes(context_len, batch_size)
    return [
        f"model {model.name}: {model.num_layers} layers, {model.num_heads} heads, "
        f"{model.num_kv_heads} KV heads, head_dim {model.head_dim}, "
        f"{model.num_params / 1e9:.2f}B params ({model.num_active_params / 1e9:.2f}B active), "
        f"weights {model.dtype}, KV {model.kv_dtype or model.dtype}",
        f"KV bytes per token: {per_token:,} "
        f"(2 x {model.num_layers} layers x {model.num_kv_heads} kv_heads x {model.head_dim} "
        f"head_dim x {model.kv_dtype_bytes:g} B) = {per_token / 1024:,.1f} KiB",
        f"KV for one {context_len:,}-token request: {one:,} B = {one / GB:,.2f} GB "
        f"= {one / GiB:,.2f} GiB",
        f"KV for {batch_size} such requests: {batch:,} B = {batch / GB:,.1f} GB "
        f"= {batch / GiB:,.1f} GiB",
    ]


def fmt_cell(v: Cell) -> str:
    """Numbers with sensible precision; NaN and None as '-'."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Cell]]) -> str:
    """A Markdown table (readable as plain text too)."""
    cells = [[fmt_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row, r in zip(rows, cells, strict=True):
        just = [
            c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
            for v, c, w in zip(row, r, widths, strict=True)
        ]
        lines.append("| " + " | ".join(just) + " |")
    return "\n".join(lines)
