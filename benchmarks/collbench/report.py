"""Rank 0's closing output: the summary lines, gpucomm beside torch.distributed, the counters its calls
moved, the JSON and the plot; after SIGINT/SIGTERM the same, then an immediate exit with status 130."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import gpucomm.torch as hvd

from .plot import write_plot
from .printing import say
from .results import Table
from .results_json import write_json
from .summary import counter_line, ratio_lines, summary_lines, summary_metric


def report(tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> None:
    """Rank 0's summary, JSON and plot."""
    say(*summary_lines(tables, hvd.size(), env["not_measured"]))
    say(*ratio_lines(tables, summary_metric(hvd.size())))
    say(counter_line(env["gpucomm_counters"]))
    ran = env["cpu_operations"]["collectives"]
    if ran["gloo"] or ran["mpi"]:
        say(f"# gpucomm's CPU collectives on rank 0 (--cpu-operations {env['cpu_operations']['asked']}): "
            f"gloo {ran['gloo']}, mpi {ran['mpi']}")
    if env["interrupted"]:
        say("# Interrupted: the sweep was stopped; the tables above hold the rows measured before that")
    if args.json:
        write_json(args.json, tables, env, args)
        print(f"# wrote {args.json}", flush=True)
    metric = summary_metric(hvd.size())
    title = f"{'bus' if metric == 'busbw' else 'algorithm'} bandwidth, {hvd.size()} ranks, {env['device_name']}"
    if args.plot and write_plot(args.plot, tables, title, metric):
        print(f"# wrote {args.plot}", flush=True)


def report_interrupted(tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> NoReturn:
    """After SIGINT/SIGTERM: rank 0 reports what it has, then every rank leaves at once (status 130).
    No collective can run any more (the other ranks are stopping too), so gpucomm's shutdown, which
    talks to them, is skipped."""
    if hvd.rank() == 0:
        report(tables, env, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
