"""Summary helpers shared by the benchmarks: statistics that answer None ("not measured") instead of
raising on empty input, ratios that survive a zero, table cells that print "n/a" for None, and JSON
that stays strict (NaN and infinities become null)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from typing import Any

NA = "n/a"


def median(values: Iterable[float]) -> float | None:
    """The median, or None when there is nothing to take it of."""
    values = list(values)
    return statistics.median(values) if values else None


def quartiles(values: Iterable[float]) -> list[float] | None:
    """[first, third] quartile, or None with fewer than two values (no spread to show). Inclusive
    method: with few values the default (exclusive) one extrapolates past the smallest and largest."""
    values = list(values)
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def value_range(values: Iterable[float]) -> list[float] | None:
    """[min, max], or None when empty."""
    values = list(values)
    return [min(values), max(values)] if values else None


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median, quartiles and range of ``values``; each None where it cannot be had."""
    values = list(values)
    return {"median": median(values), "quartiles": quartiles(values), "range": value_range(values)}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (q in 0..1); None when empty."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or not finite, or den is 0."""
    if num is None or den is None or not math.isfinite(num) or not math.isfinite(den) or den == 0:
        return None
    return num / den


def scaled(value: float | None, factor: float) -> float | None:
    """value * factor, keeping None."""
    return None if value is None else value * factor


def fmt(value: float | None, spec: str = "", na: str = NA) -> str:
    """``format(value, spec)``, or ``na`` for None and non-finite numbers."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return na
    return format(value, spec)


def fmt_pair(pair: list[float] | None, spec: str, na: str = NA) -> str:
    """"a-b" for a [low, high] pair such as quartiles, or ``na``."""
    return na if not pair else f"{format(pair[0], spec)}-{format(pair[1], spec)}"


def strict(obj: Any) -> Any:
    """A copy of ``obj`` with every non-finite float replaced by None, so it is valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as strict JSON (see ``strict``), creating the folder if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(strict(doc), f, indent=2, allow_nan=False)
