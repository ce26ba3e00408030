"""Read a gpucomm/Horovod timeline into spans, per-rank ticks and instants, and measure span overlap.

``overlap_ms(trace, a, b)`` answers "for how long were spans of kind A and kind B both
running", e.g. whether bucket allreduces overlap the backward pass::

    trace = load_trace("timeline.json")
    hidden = overlap_ms(trace, "DistributedOptimizer.backward",
                        ("DistributedOptimizer.bucket.*", "NCCL_ALLREDUCE"))
    total = busy_ms(trace, ("DistributedOptimizer.bucket.*", "NCCL_ALLREDUCE"))

Files still being written are accepted (missing ``]``, trailing ``,``/``,]``, a record cut
mid-write). Pure Python: drawing is in ``plot.py``, which re-exports everything here.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

__all__ = ["Span", "Trace", "read_records", "load_trace", "select_spans", "busy_ms", "overlap_ms",
           "merge_intervals"]

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


def merge_intervals(intervals: Iterable[tuple[float, float]], min_width: float = 0.0) -> list[tuple[float, float]]:
    """Union of (start, end) intervals, sorted and non-overlapping. ``min_width`` first widens
    shorter intervals (so zero-length spans stay visible when drawn)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        end = max(end, start + min_width)
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _union(spans: Iterable[Span]) -> list[tuple[float, float]]:
    return merge_intervals((s.start_us, s.end_us) for s in spans)


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
