"""Read a gpucomm/Horovod timeline, draw it as a Gantt chart PNG, and measure span overlap.

``render(path, "out.png")`` draws one row per timeline "process" (op name), ordered by
``sort_index``: top-level spans (the op, e.g. ALLREDUCE) as thin outlined bars, NEGOTIATE_*
spans in light grey, nested activities as filled bars coloured by label, per-rank ready ticks
(``X`` events) as small markers, ``CYCLE_START`` instants as faint vertical lines; x in ms.

``overlap_ms(trace, a, b)`` answers "for how long were spans of kind A and kind B both
running", e.g. whether bucket allreduces overlap the backward pass::

    trace = load_trace("timeline.json")
    hidden = overlap_ms(trace, "DistributedOptimizer.backward",
                        ("DistributedOptimizer.bucket.*", "NCCL_ALLREDUCE"))
    total = busy_ms(trace, ("DistributedOptimizer.bucket.*", "NCCL_ALLREDUCE"))

Files still being written are accepted (missing ``]``, trailing ``,``/``,]``, a record cut
mid-write). Drawing uses one matplotlib collection per label, so 100k records render in seconds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

__all__ = ["Span", "Trace", "read_records", "load_trace", "select_spans", "busy_ms", "overlap_ms", "render"]

# A span selector: a process-name glob (any label), or (process-name glob, label glob).
Selector = Union[str, "tuple[str, str]"]

_NEGOTIATE_COLOR = "#d9d9d9"
_OP_EDGE_COLOR = "#222222"
_DENSE_OP_COLOR = "#eeeeee"
_PLOT_WIDTH_PX = 1100  # approximate width of the axes in the 14-inch, 100-dpi figure
_ROW_HEIGHT = 0.8
_INSET_PER_DEPTH = 0.14


@dataclass(frozen=True)
class Span:
    """One matched ``B``/``E`` pair (or an ``X`` event with ``dur`` > 0) on one row.
    ``depth`` 0 is a top-level span (the op or its negotiation); 1+ are nested activities.
    ``closed`` is False for a ``B`` whose ``E`` is not in the file yet (cut at the trace end)."""

    pid: int
    process: str
    label: str
    start_us: float
    end_us: float
    depth: int
    closed: bool = True


@dataclass
class Trace:
    """A parsed timeline: rows (processes), spans, per-rank ticks, instants and counters."""

    path: str
    processes: dict[int, str] = field(default_factory=dict)
    sort_index: dict[int, int] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    markers: list[tuple[int, float, str]] = field(default_factory=list)  # (pid, ts_us, name)
    instants: list[tuple[float, str]] = field(default_factory=list)  # (ts_us, name)
    n_records: int = 0
    open_spans: int = 0
    unmatched_ends: int = 0
    start_time_since_epoch_us: int | None = None

    def name_of(self, pid: int) -> str:
        return self.processes.get(pid, f"pid {pid}")

    def rows(self) -> list[int]:
        """Pids that have spans or ticks, in display order (sort_index, then pid)."""
        used = {s.pid for s in self.spans} | {m[0] for m in self.markers}
        return sorted(used, key=lambda pid: (self.sort_index.get(pid, pid), pid))

    def time_range_us(self) -> tuple[float, float]:
        times = [t for s in self.spans for t in (s.start_us, s.end_us)]
        times += [m[1] for m in self.markers] + [i[0] for i in self.instants]
        return (min(times), max(times)) if times else (0.0, 0.0)


# -- reading -------------------------------------------------------------------------------------


def read_records(path: str) -> list[dict]:
    """The records of a Chrome-trace file (array or ``{"traceEvents": [...]}``), tolerating a
    file that is still being written. Raises OSError if unreadable, ValueError if not a trace."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path!r} is empty: the timeline was not started or nothing was written yet")
    data = _parse_tolerant(text)
    if data is None:
        raise ValueError(f"{path!r} is not a Chrome-trace JSON array (and not a partially written "
                         "one); pass the file written by gpucomm/Horovod's timeline")
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        data = data["traceEvents"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path!r} parses as JSON but is not a list of trace records "
                         "(expected [{\"ph\": ..., \"ts\": ...}, ...])")
    return data


def _parse_tolerant(text: str) -> Any:
    """json.loads, else the same text repaired as a writer would have finished it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    body = re.sub(r",\s*\]\s*$", "]", text.rstrip())  # trailing ",]"
    candidates = [body, body.rstrip().rstrip(",") + "]"]
    cut = len(body)
    for _ in range(8):  # a record cut mid-write: end after an earlier "}"
        cut = body.rfind("}", 0, cut)
        if cut < 0:
            break
        candidates.append(body[:cut + 1] + "]")
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    return None


def load_trace(source: str | Iterable[dict]) -> Trace:
    """Parse a timeline file (or an iterable of records) into spans, ticks and instants."""
    path = source if isinstance(source, str) else "<records>"
    records = read_records(source) if isinstance(source, str) else list(source)
    trace = Trace(path=path, n_records=len(records))
    per_pid: dict[int, list[tuple[float, int, str, str]]] = {}
    for seq, rec in enumerate(records):
        _take_record(trace, rec, seq, per_pid)
    trace.spans = [Span(s.pid, trace.name_of(s.pid), s.label, s.start_us, s.end_us, s.depth)
                   for s in trace.spans]  # X spans may precede their process_name record
    end_us = max([trace.time_range_us()[1]] + [e[0] for events in per_pid.values() for e in events])
    for pid, events in per_pid.items():
        _match_pairs(trace, pid, events, end_us)
    return trace


def _take_record(trace: Trace, rec: dict, seq: int, per_pid: dict) -> None:
    ph, pid, args = rec.get("ph"), rec.get("pid", 0), rec.get("args") or {}
    if ph == "M":
        if rec.get("name") == "process_name":
            if "name" in args:
                trace.processes[pid] = str(args["name"])
            if "start_time_since_epoch_in_micros" in args:
                trace.start_time_since_epoch_us = args["start_time_since_epoch_in_micros"]
        elif rec.get("name") == "process_sort_index" and "sort_index" in args:
            trace.sort_index[pid] = args["sort_index"]
        return
    ts = rec.get("ts")
    if not isinstance(ts, (int, float)):
        return
    if ph in ("B", "E"):
        per_pid.setdefault(pid, []).append((float(ts), seq, ph, str(rec.get("name", ""))))
    elif ph == "X":
        dur = rec.get("dur") or 0
        if dur > 0:
            trace.spans.append(Span(pid, "", str(rec.get("name", "")), float(ts), float(ts + dur), 0))
        else:
            trace.markers.append((pid, float(ts), str(rec.get("name", ""))))
    elif ph in ("i", "I"):
        trace.instants.append((float(ts), str(rec.get("name", ""))))


def _match_pairs(trace: Trace, pid: int, events: list, end_us: float) -> None:
    """Pair B/E of one pid in time order (file order breaks ties); unclosed B's end at end_us."""
    events.sort(key=lambda e: (e[0], e[1]))
    process, stack = trace.name_of(pid), []
    for ts, _seq, ph, name in events:
        if ph == "B":
            stack.append((ts, name))
        elif stack:
            start, label = stack.pop()
            trace.spans.append(Span(pid, process, label, start, ts, len(stack)))
        else:
            trace.unmatched_ends += 1
    trace.open_spans += len(stack)
    for depth, (start, label) in enumerate(stack):
        trace.spans.append(Span(pid, process, label, start, max(start, end_us), depth, closed=False))


# -- overlap -------------------------------------------------------------------------------------


def select_spans(trace: Trace, selector: Selector) -> list[Span]:
    """Spans whose process name matches the selector's glob (and label glob, if given)."""
    process_glob, label_glob = (selector, "*") if isinstance(selector, str) else selector
    return [s for s in trace.spans
            if fnmatch.fnmatchcase(s.process, process_glob) and fnmatch.fnmatchcase(s.label, label_glob)]


def _union(spans: Iterable[Span]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((s.start_us, s.end_us) for s in spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy_ms(trace: Trace | str, selector: Selector) -> float:
    """Total time (ms) during which at least one selected span is running (union, so
    concurrent spans are not counted twice)."""
    trace = load_trace(trace) if isinstance(trace, str) else trace
    return sum(b - a for a, b in _union(select_spans(trace, selector))) / 1000.0


def overlap_ms(trace: Trace | str, a: Selector, b: Selector) -> float:
    """Time (ms) during which at least one span selected by ``a`` and at least one selected by
    ``b`` run at the same time: |union(A) ∩ union(B)|. A selector is a process-name glob
    (any label) or a ``(process glob, label glob)`` pair; globs are case-sensitive fnmatch.
    ``overlap_ms(t, a, b) / busy_ms(t, b)`` is the fraction of B hidden behind A."""
    trace = load_trace(trace) if isinstance(trace, str) else trace
    left, right = _union(select_spans(trace, a)), _union(select_spans(trace, b))
    total, i, j = 0.0, 0, 0
    while i < len(left) and j < len(right):
        lo, hi = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        total += max(0.0, hi - lo)
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return total / 1000.0


# -- drawing -------------------------------------------------------------------------------------


def render(trace_path: str, out_png: str, *, title: str | None = None,
           window_ms: tuple[float, float] | None = None) -> dict:
    """Draw the timeline at ``trace_path`` as a Gantt chart PNG at ``out_png``; ``window_ms``
    (start, end) zooms the x axis, e.g. onto one training step of a long trace.
    Returns a summary of the whole trace: rows (names, display order), n_rows, n_records,
    n_spans, spans per label, n_markers, n_instants, open_spans, time_range_ms, png."""
    trace = load_trace(trace_path)
    rows = trace.rows()
    t0, t1 = trace.time_range_us()
    window = (t0, t1) if window_ms is None else (window_ms[0] * 1000.0, window_ms[1] * 1000.0)
    if not window[0] <= window[1]:
        raise ValueError(f"window_ms must be (start, end) with start <= end, got {window_ms!r}")
    fig = _draw(trace, rows, title if title is not None else os.path.basename(trace_path), window)
    fig.savefig(out_png, dpi=100)
    spans: dict[str, int] = {}
    for s in trace.spans:
        spans[s.label] = spans.get(s.label, 0) + 1
    return {"png": out_png, "rows": [trace.name_of(p) for p in rows], "n_rows": len(rows),
            "n_records": trace.n_records, "n_spans": len(trace.spans), "spans": spans,
            "n_markers": len(trace.markers), "n_instants": len(trace.instants),
            "open_spans": trace.open_spans, "time_range_ms": (t0 / 1000.0, t1 / 1000.0)}


def _draw(trace: Trace, rows: list[int], title: str, window: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg via savefig

    height = min(60.0, max(3.0, 1.4 + 0.32 * len(rows)))
    fig = Figure(figsize=(14, height))
    ax = fig.add_subplot()
    row_of = {pid: i for i, pid in enumerate(rows)}
    handles = _draw_spans(ax, trace, row_of, window) + _draw_ticks(ax, trace, row_of, window)
    _style_axes(ax, trace, rows, title, window)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


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


def _draw_ticks(ax: Any, trace: Trace, row_of: dict[int, int], window: tuple[float, float]) -> list:
    from matplotlib.lines import Line2D

    handles = []
    if trace.markers:
        xs = [m[1] / 1000.0 for m in trace.markers]
        ys = [row_of[m[0]] for m in trace.markers]
        ax.scatter(xs, ys, marker="|", s=30, linewidths=0.8, color="black", zorder=4)
        handles.append(Line2D([], [], marker="|", linestyle="none", color="black", label="rank ready"))
    shown = [ts / 1000.0 for ts, _ in trace.instants if window[0] <= ts <= window[1]]
    if shown and len(shown) <= _PLOT_WIDTH_PX // 4:  # denser would be a solid wash
        ax.vlines(shown, -0.5, max(len(row_of), 1) - 0.5, colors="#9ecae1", linewidths=0.3, zorder=0)
        handles.append(Line2D([], [], color="#9ecae1", label="CYCLE_START"))
    return handles


def _style_axes(ax: Any, trace: Trace, rows: list[int], title: str, window: tuple[float, float]) -> None:
    t0, t1 = window
    pad = max((t1 - t0) * 0.01, 1.0) / 1000.0
    ax.set_xlim(t0 / 1000.0 - pad, t1 / 1000.0 + pad)
    ax.set_ylim(len(rows) - 0.5 if rows else 0.5, -0.5)
    names = [trace.name_of(p) for p in rows]
    ax.set_yticks(range(len(rows)), [n if len(n) <= 48 else n[:22] + "…" + n[-23:] for n in names],
                  fontsize=8 if len(rows) <= 40 else 6)
    ax.set_xlabel("time since timeline start (ms)")
    ax.grid(axis="x", color="#eeeeee", linewidth=0.5)
    ax.set_axisbelow(True)
    subtitle = f"{len(rows)} rows, {len(trace.spans)} spans, {trace.n_records} records"
    if trace.open_spans:
        subtitle += f", {trace.open_spans} still open"
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "no events in this timeline", transform=ax.transAxes, ha="center", va="center")
