"""nccl-tests' printed layout (``src/common.cu``): the preamble, each table's header, rows and footer,
printed by rank 0 only, so every rank can call the same code."""

from __future__ import annotations

import argparse
from typing import Any

import gpucomm.torch as hvd

from bench_stats import NA as NOT_AVAILABLE, fmt

from .results import Row, Table

NA = "N/A"  # a place that does not apply (nccl-tests' spelling); NOT_AVAILABLE ("n/a") is a missing figure
AVERAGE_MODES = {0: "rank 0's time", 1: "average over ranks", 2: "minimum over ranks", 3: "maximum over ranks"}


def say(*lines: str) -> None:
    """Print ``lines`` on rank 0 (flushed: the launcher interleaves the ranks' output by line)."""
    if hvd.rank() == 0:
        for line in lines:
            print(line.rstrip(), flush=True)


def format_time(us: float) -> str:
    """nccl-tests' time cell: 7 wide, fewer decimals as the number grows."""
    return f"{us:7.0f}" if us >= 10000.0 else f"{us:7.1f}" if us >= 100.0 else f"{us:7.2f}"


def format_row(row: Row) -> str:
    """One table line: size, count, type, redop, root, then time, algbw, busbw, #wrong per place."""
    line = f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}"
    for res in (row.out_of_place, row.in_place):
        if res is None:
            line += f"  {NA:>7s}  {NA:>6s}  {NA:>6s}  {NA:>5s}"
        else:
            wrong = NA if res.wrong is None else f"{res.wrong:g}"
            line += f"  {format_time(res.time_us)}  {res.algbw:6.2f}  {res.busbw:6.2f}  {wrong:>5s}"
    return line


def table_header() -> list[str]:
    """The column titles above every table's rows."""
    return [
        "#",
        f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}           out-of-place                       in-place",
        f"# {'size':>10s}  {'count':>12s}  {'type':>8s}  {'redop':>6s}  {'root':>6s}  {'time':>7s}  {'algbw':>6s}  "
        f"{'busbw':>6s} {'#wrong':>6s}  {'time':>7s}  {'algbw':>6s}  {'busbw':>6s} {'#wrong':>6s}",
        f"# {'(B)':>10s}  {'(elements)':>12s}  {'':>8s}  {'':>6s}  {'':>6s}  {'(us)':>7s}  {'(GB/s)':>6s}  "
        f"{'(GB/s)':>6s}  {'':>5s}  {'(us)':>7s}  {'(GB/s)':>6s}  {'(GB/s)':>6s}",
    ]


def table_footer(table: Table) -> list[str]:
    """nccl-tests' footer: out-of-bounds count and average bus bandwidth (n/a, with why, for no rows)."""
    avg = fmt(table.avg_busbw, "g") if table.rows else f"{NOT_AVAILABLE} (no rows: {table.empty_reason})"
    return [f"# Out of bounds values : {table.errors} {'FAILED' if table.errors else 'OK'}",
            f"# Avg bus bandwidth    : {avg}", "#"]


def preamble(args: argparse.Namespace, devices: list[dict[str, Any]]) -> list[str]:
    """The lines before the first table: the sweep's parameters and every rank's device."""
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [f"# nRanks {hvd.size()} minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
             f"warmup iters: {args.warmup_iters} iters: {args.iters} agg iters: 1 validation: {args.check} graph: 0",
             f"# Time: {AVERAGE_MODES[args.average]} (-a {args.average})"]
    if args.blocking:
        lines.append("# Blocking Enabled: wait for completion and barrier after each collective")
    lines += ["#", "# Using devices"]
    lines += [f"#  Rank {d['rank']:2d} Pid {d['pid']:6d} on {d['host']:>10s} device {d['device']:>3s} [{d['bus_id']}] "
              f"{d['name']}" for d in devices]
    return lines
