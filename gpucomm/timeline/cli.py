"""``python -m gpucomm.timeline FILE -o out.png``: render a timeline as a PNG."""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gpucomm.timeline",
        description="Render a gpucomm/Horovod timeline (Chrome-trace JSON) as a Gantt chart PNG.")
    parser.add_argument("file", help="timeline JSON written by gpucomm or Horovod (may still be open)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None, help="chart title (default: the file name)")
    parser.add_argument("--window", nargs=2, type=float, metavar=("START_MS", "END_MS"), default=None,
                        help="draw only this time window (ms since timeline start), e.g. one step")
    return parser.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry: render FILE to a PNG, print a one-line summary; exit 2 on a bad input file."""
    args = _parse_args(argv)
    from .plot import render  # lazy: keep matplotlib out of the hot import path
    try:
        summary = render(args.file, args.output, title=args.title,
                         window_ms=None if args.window is None else tuple(args.window))
    except (OSError, ValueError) as exc:
        print(f"python -m gpucomm.timeline: error: {exc}", file=sys.stderr)
        return 2
    t0, t1 = summary["time_range_ms"]
    print(f"rendered {summary['n_rows']} rows, {summary['n_records']} records "
          f"({summary['n_spans']} spans, {summary['n_markers']} rank ticks), "
          f"{t1 - t0:.3f} ms ({t0:.3f} .. {t1:.3f} ms) -> {args.output}")
    return 0
