"""The PNG: busbw (algbw at 1 rank) against size, one panel per collective, one line per implementation
(in-place dashed). Optional: without matplotlib it says so and writes nothing."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from .impl_base import IMPLS
from .results import Table


def _size_label(nbytes: float, _pos: Any = None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def write_plot(path: str, tables: Sequence[Table], title: str, metric: str = "busbw") -> bool:
    """``metric`` (busbw, or algbw at 1 rank) against size, one panel per collective, one line per
    implementation (in-place dashed). Returns False, after saying why, when matplotlib is missing or
    no table has a row to draw."""
    if not any(t.rows for t in tables):
        print(f"# plot skipped: no table has a row to draw, so {path} was not written", flush=True)
        return False
    try:
        import matplotlib  # noqa: PLC0415 - optional: only the plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    except ImportError:
        print(f"# plot skipped: matplotlib is not installed (pip install matplotlib), so {path} was not written",
              flush=True)
        return False
    colls = list(dict.fromkeys(t.coll for t in tables))
    cols = min(3, len(colls))
    rows = math.ceil(len(colls) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(IMPLS)}
    for ax, coll in zip(axes.flat, colls):
        for t in (t for t in tables if t.coll == coll):
            _plot_table(ax, t, colors.get(t.impl, "k"), metric)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
        ax.set_title(coll)
        ax.set_xlabel("size (B)")
        ax.set_ylabel(f"{metric} (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(colls):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_table(ax: Any, table: Table, color: str, metric: str) -> None:
    """One table's lines: one per (type, op, root) series and place, in-place dashed."""
    series = list(dict.fromkeys((r.type, r.redop, r.root) for r in table.rows))
    for key in series:
        rows = [r for r in table.rows if (r.type, r.redop, r.root) == key]
        tag = "" if len(series) == 1 else " " + " ".join(str(k) for k in key if k not in ("none", -1))
        for place, style in (("out_of_place", "-o"), ("in_place", "--")):
            pts = [(r.size, getattr(getattr(r, place), metric)) for r in rows
                   if getattr(r, place) is not None and math.isfinite(getattr(getattr(r, place), metric))]
            if pts:
                suffix = "" if place == "out_of_place" else " in-place"
                ax.plot(*zip(*pts), style, color=color, markersize=3, label=f"{table.impl}{tag}{suffix}")
