"""The sweep: for each collective and implementation a table, for each case (type, op, root) a warm-up
and then one row per size; optionally several interleaved rounds merged into their medians. SIGINT and
SIGTERM stop it between calls, keeping the rows already measured."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator, Sequence
from types import FrameType

import torch

import gpucomm.torch as hvd

import anchors

from .environment import device_text
from .impl_base import Impl
from .printing import format_row, say, table_footer, table_header
from .results import Row, Table, agree, make_result, median_tables
from .sizes import REDUCING, layout
from .timing import Case, measure, warm_up


def cases_for(coll: str, impl: Impl, args: argparse.Namespace, device: torch.device) -> Iterator[Case]:
    """Every (type, op, root) the flags ask for; ops only for reducing collectives, roots for broadcast."""
    ops = args.ops_list if coll in REDUCING else ["none"]
    roots = (range(hvd.size()) if args.root == -1 else [args.root]) if coll == "broadcast" else [-1]
    for dtype_name in args.dtype_list:
        for op in ops:
            for root in roots:
                yield Case(coll, impl, dtype_name, op, root, device)


def run_row(case: Case, nbytes: int, args: argparse.Namespace) -> Row | None:
    """Both places at one size, agreed over the ranks; None when no element per rank is left."""
    elsize = torch.empty((), dtype=case.dtype).element_size()
    lay = layout(case.coll, nbytes, elsize, hvd.size())
    if lay.paramcount == 0:
        return None
    oop = measure(case, lay, False, args)
    ip = measure(case, lay, True, args)
    times, wrongs, errors = agree([oop[0], ip[0]], [oop[1], ip[1]], args.average)
    results = [make_result(case.coll, lay, elsize, t, w, bool(args.check)) for t, w in zip(times, wrongs)]
    return Row(max(lay.sendcount, lay.recvcount) * elsize, lay.paramcount, case.dtype_name, case.op, case.root,
               results[0], results[1], errors)


def run_table(table: Table, impl: Impl, sizes: Sequence[int], args: argparse.Namespace, device: torch.device) -> None:
    """Fill ``table`` row by row (so an interrupted sweep keeps the rows it measured)."""
    coll = table.coll
    say(f"# Collective {coll}, implementation {impl.name}: {impl.label}, {impl.api(coll)}; "
        f"device {device_text(device)}, {hvd.size()} ranks", *table_header())
    for case in cases_for(coll, impl, args, device):
        reason = impl.unsupported(coll, case.dtype, case.op)
        if reason:
            table.skipped.append(f"{case.dtype_name} {case.op}: {reason}")
            say(f"# skipped {case.dtype_name} {case.op}: {reason}")
            continue
        warm_up(case, sizes, args.warmup_iters)
        for nbytes in sizes:
            row = run_row(case, nbytes, args)
            anchors.add_counts(table.counters, case.counters)
            case.counters.clear()
            if row is not None:
                table.rows.append(row)
                say(format_row(row))
    say(*table_footer(table))


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_sweep(tables: list[Table], impls: Sequence[Impl], sizes: Sequence[int], args: argparse.Namespace,
              device: torch.device) -> bool:
    """Every table, appended to ``tables`` before its rows fill in; False when SIGINT or SIGTERM (the
    launcher stopping the job: Ctrl-C, or another rank failing) cut the sweep short. With
    ``--rounds R`` the sweep runs R times, each round every implementation's table in turn, and
    ``tables`` ends with the median of the rounds (``median_tables``)."""
    previous = signal.signal(signal.SIGTERM, _stop)
    rounds: list[list[Table]] = []
    try:
        for r in range(args.rounds):
            rounds.append([])
            if args.rounds > 1:
                say(f"# round {r + 1} of {args.rounds}")
            for coll in args.collectives:
                for impl in impls:
                    rounds[-1].append(Table(coll, impl.name, impl.label))
                    if args.rounds == 1:
                        tables.append(rounds[-1][-1])
                    run_table(rounds[-1][-1], impl, sizes, args, device)
    except KeyboardInterrupt:
        if args.rounds > 1 and len(rounds) > 1:  # the medians of the rounds that finished
            tables.extend(median_tables(rounds[:-1]))
            say(f"# Interrupted in round {len(rounds)}: the tables kept are the medians of the {len(rounds) - 1} "
                f"rounds that finished")
        elif args.rounds > 1 and rounds:
            tables.extend(rounds[-1])  # the first round, as far as it got
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.rounds > 1:
        tables.extend(median_tables(rounds))
        say(f"# Median of {args.rounds} interleaved rounds (time per call; bandwidths from that time)")
        for table in tables:
            say(f"# Collective {table.coll}, implementation {table.impl}: {table.label}", *table_header(),
                *(format_row(row) for row in table.rows), *table_footer(table))
    return True
