"""The closing summary: each table's average bandwidth, gpucomm's bandwidth beside its anchor
(torch.distributed) row by row, and which of gpucomm's paths its timed calls took (its counters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench_stats import NA as NOT_AVAILABLE, fmt

from .results import Table


def summary_metric(nranks: int) -> str:
    """What the summary averages: busbw, except at 1 rank, where nccl-tests' factor makes it 0 for
    every collective but broadcast, so algbw is the number that says anything."""
    return "busbw" if nranks > 1 else "algbw"


def summary_cell(table: Table, metric: str) -> str:
    """``coll/impl average`` for one table (n/a when it has no rows)."""
    value = table.average(metric) if table.rows else None
    return f"{table.coll}/{table.impl} {fmt(value, '.3g')}"


def summary_lines(tables: Sequence[Table], nranks: int, not_measured: dict[str, str]) -> list[str]:
    """The closing summary: average bandwidth per table (n/a for an empty one, with the reason on a
    line of its own), the implementations that were not measured and why, and the out-of-bounds total."""
    metric = summary_metric(nranks)
    what = ("avg bus bandwidth (GB/s)" if metric == "busbw" else
            "avg algorithm bandwidth (GB/s; at 1 rank nccl-tests' busbw is 0 for all but broadcast)")
    cells = ", ".join(summary_cell(t, metric) for t in tables) or f"{NOT_AVAILABLE} (no tables were run)"
    lines = [f"# Summary: {what}: {cells}"]
    empty: dict[str, list[str]] = {}
    for t in tables:
        if not t.rows:
            empty.setdefault(t.empty_reason, []).append(f"{t.coll}/{t.impl}")
    lines += [f"# No rows for {', '.join(names)}: {reason}" for reason, names in empty.items()]
    lines += [f"# Not measured: {name}: {reason}" for name, reason in not_measured.items()]
    failed = sum(t.errors for t in tables)
    lines.append(f"# Out of bounds values (all tables) : {failed} {'FAILED' if failed else 'OK'}")
    return lines


def ratio_lines(tables: Sequence[Table], metric: str) -> list[str]:
    """gpucomm's bandwidth over torch.distributed's, per collective and place, for rows of equal
    size, type, op and root (the comparison the README quotes); none when either is missing."""
    by = {(t.coll, t.impl): t for t in tables}
    cells = []
    for coll in dict.fromkeys(t.coll for t in tables):
        ours, theirs = by.get((coll, "gpucomm")), by.get((coll, "torch"))
        if ours is None or theirs is None:
            continue
        keys = {(r.size, r.count, r.type, r.redop, r.root) for r in ours.rows}
        plain = len({(k[2], k[3], k[4]) for k in keys}) == 1  # one type, op and root: the size says which row
        same = {(r.size, r.count, r.type, r.redop, r.root): r for r in theirs.rows}
        for a in ours.rows:
            b = same.get((a.size, a.count, a.type, a.redop, a.root))
            if b is None:  # torch skipped this case (e.g. Gloo's integer average)
                continue
            what = f"{a.size} B" if plain else f"{a.size} B {a.type} {a.redop} root {a.root}"
            for place in ("out_of_place", "in_place"):
                x, y = getattr(a, place), getattr(b, place)
                if x is not None and y is not None and getattr(y, metric) > 0:
                    cells.append(f"{coll} {place.replace('_', '-')} {what} {getattr(x, metric) / getattr(y, metric):.2f}")
    return [f"# gpucomm / torch.distributed {metric}: " + ", ".join(cells)] if cells else []


def counter_line(record: dict[str, Any]) -> str:
    """gpucomm's counters that its timed calls moved (from ``environment.counter_record``)."""
    moved = ", ".join(f"{k} {v}" for k, v in record["timed_calls"].items() if v) or "none"
    missing = record["not_in_this_gpucomm"]
    return (f"# gpucomm counters moved by its timed calls (every table, rank 0): {moved}"
            + (f" (not in this gpucomm: {', '.join(missing)})" if missing else ""))
