"""The JSON file: every row of every table as one flat ``results`` list, one summary per table, the
environment and the arguments. Strict JSON (bench_stats.write_json): a figure that is not finite is null."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bench_stats import write_json as write_strict_json

from .results import Table


def document(tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON's content: times in us, bandwidths in GB/s of 1e9 B; an empty table has null averages
    and says why in ``empty_reason``."""
    return {"benchmark": "collectives", "units": {"time_us": "us", "algbw": "GB/s", "busbw": "GB/s"},
            "env": env, "args": vars(args),
            "results": [r.as_json(t.coll, t.impl) for t in tables for r in t.rows],
            "tables": [{"collective": t.coll, "impl": t.impl, "label": t.label, "rows": len(t.rows),
                        "skipped": t.skipped, "out_of_bounds": t.errors, "avg_busbw": t.avg_busbw,
                        "avg_algbw": t.avg_algbw, "empty_reason": None if t.rows else t.empty_reason,
                        "counters": t.counters}
                       for t in tables]}


def write_json(path: str, tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> None:
    """Write ``document(...)`` to ``path`` (folders created), non-finite numbers as null."""
    write_strict_json(path, document(tables, env, args))
