"""``python -m gpucomm.timeline FILE -o out.png``: render a timeline as a PNG."""

from __future__ import annotations

import argparse
import sys
from typing import Iterable


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gpucomm.timeline",
        description="Render a gpucomm/Horovod timeline (Chrome-trace JSON) as a Gantt chart PNG: by default "
                    "one lane per phase and per fusion bucket plus the busiest ops; --per-tensor draws one "
                    "row per op name instead.")
    parser.add_argument("file", help="timeline JSON written by gpucomm or Horovod (may still be open)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None, help="chart title (default: the file name)")
    parser.add_argument("--window", nargs=2, type=float, metavar=("START_MS", "END_MS"), default=None,
                        help="draw only this time window (ms since timeline start), e.g. one step")
    parser.add_argument("--view", choices=("summary", "tensors"), default="summary",
                        help="summary: phase and bucket lanes, top ops listed (default); "
                             "tensors: one row per op name")
    parser.add_argument("--per-tensor", dest="view", action="store_const", const="tensors",
                        help="same as --view tensors")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="list the N ops with the most busy time (summary view; default 10)")
    return parser.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry: render FILE to a PNG, print a one-line summary; exit 2 on a bad input file."""
    args = _parse_args(argv)
    from .plot import render  # lazy: keep matplotlib out of the hot import path
    try:
        summary = render(args.file, args.output, title=args.title, view=args.view, top=args.top,
                         window_ms=None if args.window is None else tuple(args.window))
    except (OSError, ValueError) as exc:
        print(f"python -m gpucomm.timeline: error: {exc}", file=sys.stderr)
        return 2
    t0, t1 = summary["time_range_ms"]
    drawn = (f"{summary['n_rows']} rows" if args.view == "tensors"
             else f"{summary['n_rows']} lanes for {summary['n_names']} ops")
    print(f"rendered {drawn}, {summary['n_records']} records "
          f"({summary['n_spans']} spans, {summary['n_markers']} rank ticks), "
          f"{t1 - t0:.3f} ms ({t0:.3f} .. {t1:.3f} ms) -> {args.output}")
    return 0


__all__ = ["main"]
