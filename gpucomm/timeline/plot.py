"""Draw a gpucomm/Horovod timeline as a Gantt chart PNG: ``render(path, "out.png")``.

Two views (``view=``; CLI ``--view`` / ``--per-tensor``):

* ``"summary"`` (default) stays readable for any number of tensors: one lane per phase
  (backward pass, pack, negotiate, op in flight, wait/queue, collective, coordinator reduce,
  unpack, other; see ``summary.py`` for the label → phase map) and one lane per fusion bucket
  (``DistributedOptimizer.bucket.N``), at most ``summary.MAX_LANES`` lanes; below the chart,
  the top ops by busy time with their ms and where their time went.
* ``"tensors"``: one row per timeline "process" (op name), ordered by ``sort_index``: top-level
  spans (the op, e.g. ALLREDUCE) as thin outlined bars, NEGOTIATE_* spans in light grey, nested
  activities as filled bars coloured by label, per-rank ready ticks (``X`` events) as small
  markers. At most ``_MAX_TENSOR_ROWS`` rows (the busiest ones; the title counts the rest).

Both draw ``CYCLE_START`` instants as faint vertical lines, x in ms, and no text under 9 px.
Drawing uses one matplotlib collection per colour, so 100k records render in seconds; matplotlib
is imported only when drawing. The reader and the overlap helpers (``load_trace``,
``select_spans``, ``busy_ms``, ``overlap_ms``) live in ``trace.py`` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

from .summary import PHASE, Lane, OpTotal, build_lanes, main_phases, phase_of, rank_ops
from .reader import Span, Trace, busy_ms, load_trace, merge_intervals, overlap_ms, read_records, select_spans

__all__ = ["Span", "Trace", "read_records", "load_trace", "select_spans", "busy_ms", "overlap_ms", "render",
           "VIEWS"]

VIEWS = ("summary", "tensors")

_DPI = 100
_FIG_WIDTH_IN = 14.0
_PLOT_WIDTH_PX = 1100  # approximate width of the axes in the 14-inch, 100-dpi figure
_LABEL_PT = 9  # 12.5 px at 100 dpi
_SMALL_PT = 7  # the smallest text drawn: 9.7 px at 100 dpi
_MAX_TENSOR_ROWS = 300  # more rows than this in a 6000-px image would overlap their labels
_NEGOTIATE_COLOR = "#d9d9d9"
_OP_EDGE_COLOR = "#222222"
_DENSE_OP_COLOR = "#eeeeee"
_TICK_COLOR = "#333333"
_CYCLE_COLOR = "#9ecae1"
_ROW_HEIGHT = 0.8
_INSET_PER_DEPTH = 0.14


def render(trace_path: str, out_png: str, *, title: str | None = None,
           window_ms: tuple[float, float] | None = None, view: str = "summary", top: int = 10) -> dict:
    """Draw the timeline at ``trace_path`` as a PNG at ``out_png``: ``view="summary"`` (phase
    and bucket lanes, the ``top`` ops listed) or ``"tensors"`` (one row per op name).
    ``window_ms`` (start, end) zooms the x axis, e.g. onto one training step of a long trace.

    Returns a summary: view, rows (lane titles or op names, display order), n_rows,
    n_hidden_rows, n_names (op names in the trace), n_records, n_spans, spans per label,
    n_markers, n_instants, open_spans, time_range_ms (whole trace), top (the busiest ops in
    the window: name, busy_ms, n_ops, phase_ms), labels (every text drawn), min_font_px,
    image_px (width, height) and png."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}: 'summary' draws phase/bucket "
                         "lanes, 'tensors' one row per op name")
    trace = load_trace(trace_path)
    t0, t1 = trace.time_range_us()
    window = (t0, t1) if window_ms is None else (window_ms[0] * 1000.0, window_ms[1] * 1000.0)
    if not window[0] <= window[1]:
        raise ValueError(f"window_ms must be (start, end) with start <= end, got {window_ms!r}")
    ranked, n_ranked = rank_ops(trace, window, top)
    title = title if title is not None else os.path.basename(trace_path)
    if view == "summary":
        fig, rows, hidden = _draw_summary(trace, title, window, ranked, n_ranked, whole=window_ms is None)
    else:
        fig, rows, hidden = _draw_tensors(trace, title, window)
    fig.savefig(out_png, dpi=_DPI)
    min_font_px, labels = _texts(fig)
    spans: dict[str, int] = {}
    for s in trace.spans:
        spans[s.label] = spans.get(s.label, 0) + 1
    return {"png": out_png, "view": view, "rows": rows, "n_rows": len(rows), "n_hidden_rows": hidden,
            "n_names": len(trace.rows()), "n_records": trace.n_records, "n_spans": len(trace.spans),
            "spans": spans, "n_markers": len(trace.markers), "n_instants": len(trace.instants),
            "open_spans": trace.open_spans, "time_range_ms": (t0 / 1000.0, t1 / 1000.0),
            "top": [dataclasses.asdict(t) for t in ranked], "labels": labels,
            "min_font_px": min_font_px, "image_px": _png_size(out_png)}


def _texts(fig: Any) -> tuple[float, list[str]]:
    """The smallest font (px) among the figure's non-empty visible texts, and those texts."""
    from matplotlib.text import Text

    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    sizes = [t.get_fontsize() * fig.dpi / 72.0 for t in texts]
    return (min(sizes) if sizes else 0.0), [t.get_text() for t in texts]


def _png_size(path: str) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _short(name: str, limit: int) -> str:
    """``name`` cut in the middle to at most ``limit`` characters."""
    if len(name) <= limit:
        return name
    keep = limit - 1
    return name[:keep // 2] + "…" + name[len(name) - (keep - keep // 2):]


# -- summary view --------------------------------------------------------------------------------


def _draw_summary(trace: Trace, title: str, window: tuple[float, float], ranked: list[OpTotal],
                  n_ranked: int, whole: bool) -> tuple[Any, list[str], int]:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg via savefig

    lanes = build_lanes(trace, window)
    handles = _summary_legend(trace, lanes)
    gantt_in = max(1.0, 0.28 * len(lanes), 0.22 * len(handles) + 0.3)  # the legend must fit beside it
    table_in = 0.2 * (len(ranked) + 1) + 0.3
    fig = Figure(figsize=(_FIG_WIDTH_IN, gantt_in + table_in + 1.5))
    grid = fig.add_gridspec(2, 1, height_ratios=[gantt_in, table_in])
    ax, table = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    _draw_lanes(ax, lanes, window)
    _draw_instants(ax, trace, window, len(lanes), handles)
    n_buckets = sum(lane.phase is None for lane in lanes)
    subtitle = (f"summary of {len(trace.rows())} op names: {len(lanes) - n_buckets} phase lanes, "
                f"{n_buckets} bucket lanes; {len(trace.spans):,} spans, {trace.n_records:,} records")
    _style_axes(ax, [lane.label() for lane in lanes], title, _with_open(subtitle, trace), window, _LABEL_PT)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=_LABEL_PT,
                  frameon=False)
    scope = "in the whole trace" if whole else f"in {window[0] / 1000.0:.1f}-{window[1] / 1000.0:.1f} ms"
    _draw_ranking(table, ranked, n_ranked, scope, table_in)
    fig.tight_layout()
    return fig, [lane.title for lane in lanes], 0


def _summary_legend(trace: Trace, lanes: list[Lane]) -> list:
    """Legend entries: each phase drawn (with the labels it stands for), ticks, cycles."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    phases = {phase_of(s.label) for lane in lanes for s in lane.spans}
    handles = []
    for key, phase in PHASE.items():
        if key in phases:
            labels = phase.labels
            if key == "other":
                others = sorted({s.label for s in trace.spans if phase_of(s.label) == "other"})
                labels = ", ".join(_short(o, 24) for o in others[:3]) + (", ..." if len(others) > 3 else "")
            handles.append(Patch(facecolor=phase.color, label=f"{phase.title}: {labels}"))
    if any(lane.ticks for lane in lanes):
        handles.append(Line2D([], [], marker="|", linestyle="none", color=_TICK_COLOR, label="a rank ready"))
    return handles


def _draw_lanes(ax: Any, lanes: list[Lane], window: tuple[float, float]) -> None:
    """Each lane's spans merged per phase (one PolyCollection per phase): full height in a
    phase lane; in a bucket lane the op span is the background and its phases sit inside it."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    min_width = 2 * max(window[1] - window[0], 1.0) / _PLOT_WIDTH_PX  # 2 px: zero-length spans show
    boxes: dict[tuple[str, bool], list] = {}
    for row, lane in enumerate(lanes):
        by_phase: dict[str, list[tuple[float, float]]] = {}
        for s in lane.spans:
            by_phase.setdefault(phase_of(s.label), []).append((s.start_us, s.end_us))
        for key, intervals in by_phase.items():
            inner = lane.phase is None and key != "op"
            half = _ROW_HEIGHT / 2 * (0.6 if inner else 1.0)
            boxes.setdefault((key, inner), []).append(_interval_boxes(merge_intervals(intervals, min_width), row, half))
    for (key, inner), parts in boxes.items():
        ax.add_collection(PolyCollection(np.concatenate(parts), facecolors=PHASE[key].color,
                                         edgecolors="none", zorder=2 if inner or key != "op" else 1))
    xs = [ts / 1000.0 for lane in lanes for ts in lane.ticks]
    ys = [row for row, lane in enumerate(lanes) for _ in lane.ticks]
    if xs:
        ax.scatter(xs, ys, marker="|", s=40, linewidths=0.6, color=_TICK_COLOR, alpha=0.7, zorder=4)


def _interval_boxes(intervals: list[tuple[float, float]], row: int, half: float) -> Any:
    """(n, 4, 2) rectangle vertices in (ms, row) for intervals in µs."""
    import numpy as np

    if not intervals:
        return np.zeros((0, 4, 2))
    x = np.asarray(intervals, float) / 1000.0
    y0 = np.full(len(x), row - half)
    y1 = np.full(len(x), row + half)
    return np.stack([np.stack([x[:, 0], y0], 1), np.stack([x[:, 1], y0], 1),
                     np.stack([x[:, 1], y1], 1), np.stack([x[:, 0], y1], 1)], 1)


def _draw_ranking(ax: Any, ranked: list[OpTotal], n_ranked: int, scope: str, height_in: float) -> None:
    """The busiest ops as a ranked list, one monospace line each: busy ms, runs, main phases."""
    ax.axis("off")
    step = 0.2 / height_in  # one line (0.2 inch) in axes fractions
    header = (f"Top {len(ranked)} of {n_ranked} ops by busy time {scope}: busy ms, times run, where the time went"
              if ranked else f"no ops {scope}")
    ax.text(0.0, 1.0, header, transform=ax.transAxes, va="top", ha="left", fontsize=_LABEL_PT + 1,
            fontweight="bold")
    for i, t in enumerate(ranked):
        line = f"{i + 1:>2}. {_short(t.name, 60):<60} {t.busy_ms:>11.3f} ms {t.n_ops:>6}x   {main_phases(t)}"
        ax.text(0.0, 1.0 - (i + 1) * step, line, transform=ax.transAxes, va="top", ha="left",
                fontsize=_LABEL_PT, family="monospace")


# -- per-tensor view -----------------------------------------------------------------------------


def _draw_tensors(trace: Trace, title: str, window: tuple[float, float]) -> tuple[Any, list[str], int]:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg via savefig

    trace, rows, hidden = _busiest_rows(trace, _MAX_TENSOR_ROWS)
    height = min(60.0, max(3.0, 1.4 + 0.32 * len(rows)))
    fig = Figure(figsize=(_FIG_WIDTH_IN, height))
    ax = fig.add_subplot()
    row_of = {pid: i for i, pid in enumerate(rows)}
    handles = _draw_spans(ax, trace, row_of, window) + _draw_ticks(ax, trace, row_of)
    _draw_instants(ax, trace, window, len(rows), handles)
    names = [trace.name_of(p) for p in rows]
    subtitle = f"{len(rows)} rows, {len(trace.spans)} spans, {trace.n_records} records"
    if hidden:
        subtitle += f"; {hidden} more rows (least busy) not drawn"
    _style_axes(ax, [_short(n, 48) for n in names], title, _with_open(subtitle, trace), window,
                8 if len(rows) <= 40 else _SMALL_PT)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig, names, hidden


def _busiest_rows(trace: Trace, limit: int) -> tuple[Trace, list[int], int]:
    """The trace restricted to its ``limit`` busiest rows (display order kept), and how many
    rows were left out. Record counts stay those of the whole trace."""
    rows = trace.rows()
    if len(rows) <= limit:
        return trace, rows, 0
    per_pid: dict[int, list] = {}
    for s in trace.spans:
        per_pid.setdefault(s.pid, []).append((s.start_us, s.end_us))
    busy = {pid: sum(b - a for a, b in merge_intervals(per_pid.get(pid, []))) for pid in rows}
    kept = set(sorted(rows, key=lambda pid: (-busy[pid], pid))[:limit])
    shown = dataclasses.replace(trace, spans=[s for s in trace.spans if s.pid in kept],
                                markers=[m for m in trace.markers if m[0] in kept])
    return shown, [pid for pid in rows if pid in kept], len(rows) - limit


def _span_groups(trace: Trace) -> dict[tuple[str, str], list[Span]]:
    """Spans keyed by (style, label): "negotiate", "op" (top level) or "activity"."""
    groups: dict[tuple[str, str], list[Span]] = {}
    for s in trace.spans:
        style = "negotiate" if s.label.startswith("NEGOTIATE") else "op" if s.depth == 0 else "activity"
        groups.setdefault((style, "" if style == "negotiate" else s.label), []).append(s)
    return groups


def _boxes(spans: list[Span], row_of: dict[int, int]) -> Any:
    """(n, 4, 2) rectangle vertices in (ms, row) for a PolyCollection."""
    import numpy as np

    x0 = np.fromiter((s.start_us for s in spans), float, len(spans)) / 1000.0
    x1 = np.fromiter((s.end_us for s in spans), float, len(spans)) / 1000.0
    row = np.fromiter((row_of[s.pid] for s in spans), float, len(spans))
    inset = np.fromiter((min(s.depth, 3) * _INSET_PER_DEPTH for s in spans), float, len(spans))
    y0 = row - _ROW_HEIGHT / 2 + inset * _ROW_HEIGHT
    y1 = row + _ROW_HEIGHT / 2 - inset * _ROW_HEIGHT
    return np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1),
                     np.stack([x1, y1], 1), np.stack([x0, y1], 1)], 1)


def _is_dense(spans: list[Span], window: tuple[float, float]) -> bool:
    """True if the typical top-level span is under ~3 px wide at the chart's time scale."""
    widths = sorted(s.end_us - s.start_us for s in spans)
    return bool(widths) and widths[len(widths) // 2] * _PLOT_WIDTH_PX / max(window[1] - window[0], 1e-9) < 3


def _draw_spans(ax: Any, trace: Trace, row_of: dict[int, int], window: tuple[float, float]) -> list:
    from matplotlib import colormaps
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    groups = _span_groups(trace)
    dense = _is_dense([s for (style, _), spans in groups.items() if style == "op" for s in spans], window)
    labels = sorted(label for style, label in groups if style == "activity")
    palette = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    color = {label: palette(i % palette.N) for i, label in enumerate(labels)}
    handles = []
    for (style, label), spans in sorted(groups.items(), key=lambda kv: ("negotiate", "op", "activity").index(kv[0][0])):
        if style == "negotiate":
            kw = dict(facecolors=_NEGOTIATE_COLOR, edgecolors="none", zorder=1)
            handles.append(Patch(facecolor=_NEGOTIATE_COLOR, label="NEGOTIATE_*"))
        elif style == "op" and dense:  # outlines narrower than a few pixels would paint rows black
            kw = dict(facecolors=_DENSE_OP_COLOR, edgecolors="none", zorder=1)
        elif style == "op":
            kw = dict(facecolors="none", edgecolors=_OP_EDGE_COLOR, linewidths=0.6, zorder=3)
        else:
            kw = dict(facecolors=color[label], edgecolors="none", zorder=2)
            handles.append(Patch(facecolor=color[label], label=label))
        ax.add_collection(PolyCollection(_boxes(spans, row_of), **kw))
    op_labels = sorted(label for style, label in groups if style == "op")
    if op_labels:
        text = ", ".join(op_labels[:4]) + (", ..." if len(op_labels) > 4 else "")
        face, edge = (_DENSE_OP_COLOR, "none") if dense else ("none", _OP_EDGE_COLOR)
        handles.insert(0, Patch(facecolor=face, edgecolor=edge, label=f"op span ({text})"))
    return handles


def _draw_ticks(ax: Any, trace: Trace, row_of: dict[int, int]) -> list:
    from matplotlib.lines import Line2D

    if not trace.markers:
        return []
    xs = [m[1] / 1000.0 for m in trace.markers]
    ys = [row_of[m[0]] for m in trace.markers]
    ax.scatter(xs, ys, marker="|", s=30, linewidths=0.8, color="black", zorder=4)
    return [Line2D([], [], marker="|", linestyle="none", color="black", label="rank ready")]


# -- shared --------------------------------------------------------------------------------------


def _draw_instants(ax: Any, trace: Trace, window: tuple[float, float], n_rows: int, handles: list) -> None:
    """CYCLE_START (and other global instants) as faint vertical lines, unless so dense they
    would be a solid wash; adds their legend entry to ``handles``."""
    from matplotlib.lines import Line2D

    shown = [ts / 1000.0 for ts, _ in trace.instants if window[0] <= ts <= window[1]]
    if shown and len(shown) <= _PLOT_WIDTH_PX // 4:
        ax.vlines(shown, -0.5, max(n_rows, 1) - 0.5, colors=_CYCLE_COLOR, linewidths=0.3, zorder=0)
        handles.append(Line2D([], [], color=_CYCLE_COLOR, label="CYCLE_START"))


def _with_open(subtitle: str, trace: Trace) -> str:
    return subtitle + (f", {trace.open_spans} still open" if trace.open_spans else "")


def _style_axes(ax: Any, labels: list[str], title: str, subtitle: str, window: tuple[float, float],
                label_pt: float) -> None:
    t0, t1 = window
    pad = max((t1 - t0) * 0.01, 1.0) / 1000.0
    ax.set_xlim(t0 / 1000.0 - pad, t1 / 1000.0 + pad)
    ax.set_ylim(len(labels) - 0.5 if labels else 0.5, -0.5)
    ax.set_yticks(range(len(labels)), labels, fontsize=label_pt)
    ax.tick_params(axis="x", labelsize=_LABEL_PT)
    ax.set_xlabel("time since timeline start (ms)", fontsize=_LABEL_PT + 1)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    if not labels:
        ax.text(0.5, 0.5, "no events in this timeline", transform=ax.transAxes, ha="center", va="center",
                fontsize=_LABEL_PT + 1)
