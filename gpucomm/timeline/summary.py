"""Aggregation for the summary picture of a timeline: which *phase* a span label belongs to, the
picture's lanes (one per phase present, one per fusion bucket) and the ops ranked by busy time.

A per-op picture needs one row per op name (331 rows for a ResNet-50 run); these lanes stay
under ``MAX_LANES`` whatever the number of tensors. Labels map to phases as gpucomm writes them
(``tracer.py``, the optimizer) and as Horovod does; an unknown label goes to "other", never an
error. Pure Python (no matplotlib): ``plot.py`` draws what this module computes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .reader import Span, Trace, merge_intervals

__all__ = ["MAX_LANES", "PHASES", "Phase", "Lane", "OpTotal", "phase_of", "build_lanes", "rank_ops",
           "main_phases"]

MAX_LANES = 60  # the summary picture never has more lanes than this


@dataclass(frozen=True)
class Phase:
    """A lane of the summary picture: ``key``, its lane ``title``, the timeline labels that map
    to it (legend text) and its colour."""

    key: str
    title: str
    labels: str
    color: str


# In pipeline order: the lanes are drawn top to bottom in this order.
PHASES = (
    Phase("backward", "backward pass", "BACKWARD", "#9467bd"),
    Phase("pack", "pack", "MEMCPY_IN_FUSION_BUFFER", "#ff7f0e"),
    Phase("negotiate", "negotiate", "NEGOTIATE_*, | = a rank ready", "#b0b0b0"),
    Phase("op", "op in flight", "op span: ALLREDUCE, BROADCAST, ...", "#dcdcdc"),
    Phase("wait", "wait / queue", "QUEUE, WAIT_FOR_*", "#17becf"),
    Phase("collective", "collective", "GLOO_*, NCCL_*, MPI_*", "#1f77b4"),
    Phase("inline", "coordinator reduce", "COORDINATOR_REDUCE (inline)", "#2ca02c"),
    Phase("unpack", "unpack", "MEMCPY_OUT_FUSION_BUFFER", "#d62728"),
    Phase("other", "other", "any other label", "#8c564b"),
)
PHASE = {p.key: p for p in PHASES}

_EXACT = {"BACKWARD": "backward", "MEMCPY_IN_FUSION_BUFFER": "pack", "MEMCPY_OUT_FUSION_BUFFER": "unpack",
          "QUEUE": "wait", "COORDINATOR_REDUCE": "inline"}
_PREFIXES = (("NEGOTIATE_", "negotiate"), ("GLOO_", "collective"), ("NCCL_", "collective"),
             ("MPI_", "collective"), ("WAIT_FOR_", "wait"))
# Top-level op spans: gpucomm's request kinds upper-cased, and Horovod's response types.
_OP_KINDS = frozenset({"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "REDUCE_SCATTER",
                       "GROUPED_ALLREDUCE", "ADASUM", "BARRIER", "JOIN", "ADD_PROCESS_SET",
                       "REMOVE_PROCESS_SET", "ERROR"})
_BUCKET = re.compile(r"^DistributedOptimizer\.bucket\.(\d+)$")


def phase_of(label: str) -> str:
    """The phase key of a span label ("other" for a label this module does not know)."""
    phase = _EXACT.get(label)
    if phase is not None:
        return phase
    for prefix, phase in _PREFIXES:
        if label.startswith(prefix):
            return phase
    return "op" if label in _OP_KINDS else "other"


@dataclass
class Lane:
    """One row of the summary picture. A phase lane (``phase`` set) holds every span of that
    phase, whatever its op; a bucket lane (``phase`` None) holds all spans of one or more
    fusion buckets, drawn coloured by phase. ``busy_us`` is the union of its spans in the window."""

    title: str
    phase: str | None
    spans: list[Span] = field(default_factory=list)
    ticks: list[float] = field(default_factory=list)  # rank-ready tick times (µs)
    busy_us: float = 0.0
    n_inside: int = 0  # spans in the window

    def label(self) -> str:
        """The lane's y-axis text: title, span count and busy time in the window."""
        return f"{self.title}  ({self.n_inside:,} spans, {self.busy_us / 1000.0:,.1f} ms)"


def _clip(start: float, end: float, window: tuple[float, float]) -> tuple[float, float] | None:
    """(start, end) cut to the window, or None if it lies outside."""
    if end < window[0] or start > window[1]:
        return None
    return max(start, window[0]), min(end, window[1])


def _inside(spans: list[Span], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The spans' (start, end) cut to the window, those outside left out."""
    clipped = (_clip(s.start_us, s.end_us, window) for s in spans)
    return [c for c in clipped if c is not None]


def _phase_lanes(trace: Trace) -> list[Lane]:
    by_phase: dict[str, Lane] = {}
    for s in trace.spans:
        key = phase_of(s.label)
        by_phase.setdefault(key, Lane(PHASE[key].title, key)).spans.append(s)
    if trace.markers:  # rank-ready ticks belong to negotiation, even if its spans are not in yet
        negotiate = by_phase.setdefault("negotiate", Lane(PHASE["negotiate"].title, "negotiate"))
        negotiate.ticks = [m[1] for m in trace.markers]
    return [by_phase[p.key] for p in PHASES if p.key in by_phase]


def _bucket_lanes(trace: Trace, room: int) -> list[Lane]:
    """One lane per fusion bucket; buckets share lanes (consecutive indices) if they exceed ``room``."""
    index = {pid: int(m.group(1)) for pid in trace.rows() if (m := _BUCKET.match(trace.name_of(pid)))}
    buckets = sorted(set(index.values()))
    if not buckets or room <= 0:
        return []
    per_lane = math.ceil(len(buckets) / room)
    groups = [buckets[i:i + per_lane] for i in range(0, len(buckets), per_lane)]
    lane_of = {b: i for i, group in enumerate(groups) for b in group}
    lanes = [Lane(f"bucket {g[0]}" if len(g) == 1 else f"buckets {g[0]}-{g[-1]}", None) for g in groups]
    for s in trace.spans:
        if s.pid in index:
            lanes[lane_of[index[s.pid]]].spans.append(s)
    for pid, ts, _name in trace.markers:
        if pid in index:
            lanes[lane_of[index[pid]]].ticks.append(ts)
    return lanes


def build_lanes(trace: Trace, window: tuple[float, float], max_lanes: int = MAX_LANES) -> list[Lane]:
    """The summary picture's lanes: the phases present (pipeline order), then the buckets,
    at most ``max_lanes`` in all. Busy times are measured inside ``window`` (µs)."""
    lanes = _phase_lanes(trace)
    lanes += _bucket_lanes(trace, max_lanes - len(lanes))
    for lane in lanes:
        inside = _inside(lane.spans, window)
        lane.n_inside, lane.busy_us = len(inside), sum(b - a for a, b in merge_intervals(inside))
    return lanes


@dataclass(frozen=True)
class OpTotal:
    """One op name's share of the window: busy time (union of its spans), how many times it
    ran, and the summed time of each of its phases (the op span only if there is nothing else:
    it encloses the other phases)."""

    name: str
    busy_ms: float
    n_ops: int
    phase_ms: dict[str, float]


def _op_total(name: str, spans: list[Span], window: tuple[float, float]) -> OpTotal | None:
    """``name``'s totals from its spans inside ``window`` (None if it has none there)."""
    inside = [(s, c) for s in spans if (c := _clip(s.start_us, s.end_us, window)) is not None]
    if not inside:
        return None
    phase_ms: dict[str, float] = {}
    counts = {"op": 0, "negotiate": 0}
    for s, (start, end) in inside:
        key = phase_of(s.label)
        if key in counts:
            counts[key] += 1
        phase_ms[key] = phase_ms.get(key, 0.0) + (end - start) / 1000.0
    if len(phase_ms) > 1:  # op spans enclose the other phases: keep them only if alone
        phase_ms.pop("op", None)
    busy_us = sum(b - a for a, b in merge_intervals(c for _, c in inside))
    return OpTotal(name, busy_us / 1000.0, max(counts.values()), phase_ms)


def rank_ops(trace: Trace, window: tuple[float, float], top: int = 10) -> tuple[list[OpTotal], int]:
    """The ``top`` op names by busy time inside ``window`` (µs), longest first (ties by name),
    and how many names have spans there. The backward pass is a reference, not an op: left out."""
    by_pid: dict[int, list[Span]] = {}
    for s in trace.spans:
        by_pid.setdefault(s.pid, []).append(s)
    totals = [t for pid, spans in by_pid.items() if any(phase_of(s.label) != "backward" for s in spans)
              if (t := _op_total(trace.name_of(pid), spans, window)) is not None]
    totals.sort(key=lambda t: (-t.busy_ms, t.name))
    return totals[:max(0, top)], len(totals)


def main_phases(total: OpTotal, n: int = 2) -> str:
    """The ``n`` phases that took most of an op's time, as "collective 71%, negotiate 22%"."""
    whole = sum(total.phase_ms.values())
    if whole <= 0:
        return "-"
    ranked = sorted(total.phase_ms.items(), key=lambda kv: -kv[1])[:n]
    shares = ((PHASE[key].title, 100.0 * ms / whole) for key, ms in ranked)
    return ", ".join(f"{title} {pct:.0f}%" if pct >= 0.5 else f"{title} <1%" for title, pct in shares)
