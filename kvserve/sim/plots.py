"""PNG plots of the experiments (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Series = tuple[str, Sequence[float], Sequence[float]]  # (label, x, y)


def save_figure(
    out_dir: str,
    name: str,
    panels: Sequence[tuple[str, str, str, Sequence[Series], bool]],
    suptitle: str,
) -> str:
    """Save side-by-side line panels to ``out_dir/name.png``; returns the path.

    Each panel is ``(title, xlabel, ylabel, series, log_x)``.
    """
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (title, xlabel, ylabel, series, log_x) in zip(axes[0], panels, strict=False):
        for label, x, y in series:
            ax.plot(list(x), list(y), marker="o" if len(x) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(suptitle)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_bars(
    out_dir: str,
    name: str,
    panels: Sequence[tuple[str, str, Sequence[str], Sequence[float]]],
    suptitle: str,
) -> str:
    """Save side-by-side bar panels ``(title, ylabel, labels, values)``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (title, ylabel, labels, values) in zip(axes[0], panels, strict=False):
        ax.bar(range(len(values)), list(values), color="tab:blue")
        ax.set_xticks(range(len(values)), list(labels), rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(suptitle)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
