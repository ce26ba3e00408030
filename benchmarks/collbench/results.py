"""A row's and a table's numbers: time per call, algbw, busbw and #wrong per place (out-of-place,
in-place), the ranks' agreement on them (nccl-tests' -a), and the median of several interleaved rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import gpucomm.torch as hvd

import anchors
from bench_stats import median

from .sizes import Layout, bandwidth


@dataclass
class Result:
    """One place's numbers: time per call (us), bandwidths (GB/s of 1e9 B), wrong elements."""

    time_us: float
    algbw: float
    busbw: float
    wrong: float | None  # None: not checked (-c 0)

    def as_json(self) -> dict[str, Any]:
        return {"time_us": self.time_us, "algbw": self.algbw, "busbw": self.busbw, "wrong": self.wrong}


@dataclass
class Row:
    """One size of one case: nccl-tests' row, None for a place that does not apply (N/A)."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Result | None
    in_place: Result | None
    errors: int = 0  # (rank, place) pairs with wrong elements: nccl-tests' "Out of bounds values"

    def as_json(self, coll: str, impl: str) -> dict[str, Any]:
        """One entry of the JSON's ``results``; a place that does not apply (N/A) is an empty object."""
        return {"collective": coll, "impl": impl, "bytes": self.size, "count": self.count, "type": self.type,
                "redop": self.redop, "root": self.root,
                "out_of_place": self.out_of_place.as_json() if self.out_of_place else {},
                "in_place": self.in_place.as_json() if self.in_place else {}}


@dataclass
class Table:
    """Every row of one (collective, implementation), with the cases it skipped and the counters moved."""

    coll: str
    impl: str
    label: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # gpucomm's counters moved by the timed calls

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.rows)

    @property
    def avg_busbw(self) -> float | None:
        """nccl-tests' "Avg bus bandwidth" over every timed cell; None when the table has no rows."""
        return self.average("busbw")

    @property
    def avg_algbw(self) -> float | None:
        return self.average("algbw")

    def average(self, metric: str) -> float | None:
        """The mean of ``metric`` over every finite timed cell; None when there is none."""
        values = [getattr(res, metric) for r in self.rows for res in (r.out_of_place, r.in_place) if res is not None]
        values = [v for v in values if math.isfinite(v)]
        return sum(values) / len(values) if values else None

    @property
    def empty_reason(self) -> str:
        """Why the table has no rows (only meaningful when it has none)."""
        if self.skipped:
            return "every case skipped: " + "; ".join(self.skipped)
        return "no size in the sweep leaves an element per rank (raise -b or -e)"


def agree(seconds: Sequence[float], wrong: Sequence[float], mode: int) -> tuple[list[float], list[float], int]:
    """Every rank's (time, wrong) per place, reduced the same way on every rank: time by ``mode``
    (nccl-tests' -a), #wrong summed; plus the number of (rank, place) pairs that saw wrong elements."""
    mine = torch.tensor([list(seconds) + list(wrong)], dtype=torch.float64)
    every = hvd.allgather(mine)  # (ranks, 2 * places), CPU tensor: Gloo, whatever the benchmark's device
    k = len(seconds)
    times = every[:, :k]
    pick = {0: lambda t: t[0], 1: lambda t: t.mean(0), 2: lambda t: t.amin(0), 3: lambda t: t.amax(0)}[mode]
    wrongs = every[:, k:]
    errors = int((wrongs.nan_to_num(0) > 0).sum())
    return pick(times).tolist(), wrongs.sum(0).tolist(), errors


def make_result(coll: str, lay: Layout, elsize: int, seconds: float, wrong: float, checked: bool) -> Result | None:
    """The place's numbers from its agreed time (None where the place does not apply: NaN time)."""
    if math.isnan(seconds):
        return None
    algbw, busbw = bandwidth(coll, lay.paramcount, elsize, hvd.size(), seconds)
    return Result(seconds * 1e6, algbw, busbw, wrong if checked else None)


def _median_result(results: Sequence[Result | None]) -> Result | None:
    kept = [r for r in results if r is not None and math.isfinite(r.time_us) and r.time_us > 0]
    if not kept:
        return results[0]
    t = median([r.time_us for r in kept])
    scale = kept[0].time_us / t  # bandwidth is bytes / time: rescale one round's to the median time
    wrongs = [r.wrong for r in kept if r.wrong is not None]
    return Result(t, kept[0].algbw * scale, kept[0].busbw * scale, max(wrongs) if wrongs else None)


def median_tables(rounds: Sequence[Sequence[Table]]) -> list[Table]:
    """One table per (collective, implementation): each cell's median time over the rounds (each
    round has the same tables in the same order, with the same rows); #wrong and errors the worst."""
    merged = []
    shape = [(t.coll, t.impl, len(t.rows)) for t in rounds[0]]
    if any([(t.coll, t.impl, len(t.rows)) for t in r] != shape for r in rounds):
        raise ValueError("median_tables: the rounds differ in their tables or rows; every round must run the same sweep")
    for same in zip(*rounds):
        first = same[0]
        table = Table(first.coll, first.impl, first.label, skipped=list(first.skipped))
        for t in same:
            anchors.add_counts(table.counters, t.counters)
        for rows in zip(*(t.rows for t in same)):
            r0 = rows[0]
            table.rows.append(Row(r0.size, r0.count, r0.type, r0.redop, r0.root,
                                  _median_result([r.out_of_place for r in rows]),
                                  _median_result([r.in_place for r in rows]), max(r.errors for r in rows)))
        merged.append(table)
    return merged
