"""Collective cost curves: the time one allreduce of ``nbytes`` takes.

The model of a step (``step.py``) needs only a function ``cost(nbytes) -> seconds``. Three kinds are
built here or beside it: an α-β line fitted from measured (bytes, seconds) samples of the machine at
hand (Gloo or NCCL), the measured samples themselves (``MeasuredCurve``), and NCCL's own published
cost model for machines we do not have (``nccl.py``). Times are seconds, sizes bytes, bandwidths bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..errors import FitError

__all__ = ["CostFn", "AlphaBeta", "MeasuredCurve", "fit_alpha_beta", "medians", "ring_allreduce", "FitError"]

CostFn = Callable[[int], float]
"""``cost(nbytes) -> seconds`` of one collective."""


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha_s + nbytes / bandwidth_Bps``: a fixed start-up cost and a bandwidth (Hockney's model)."""

    alpha_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"AlphaBeta: alpha_s={self.alpha_s!r} must be a finite number of seconds >= 0.")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"AlphaBeta: bandwidth_Bps={self.bandwidth_Bps!r} must be > 0 bytes per second "
                             "(math.inf for a transfer that costs nothing per byte).")

    def __call__(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bandwidth_Bps

    def to_dict(self) -> dict[str, float]:
        """JSON-ready: ``{"alpha_s": ..., "bandwidth_Bps": ...}``."""
        return {"alpha_s": self.alpha_s, "bandwidth_Bps": self.bandwidth_Bps}


def fit_alpha_beta(samples: Iterable[tuple[float, float]], *, relative: bool = True) -> AlphaBeta:
    """Least-squares α-β line through ``(nbytes, seconds)`` samples.

    ``relative=True`` (default) weighs each sample by 1/seconds², so every size counts by its
    relative error and the small sizes, which alone tell α, are not drowned by the large ones; with
    ``relative=False`` it is plain least squares. Repeated sizes are fine (pass every repetition, or
    their medians). A negative intercept (a line that would promise less than nothing for tiny
    messages) is clamped to 0 and the slope refitted through the origin.
    """
    pts = [(float(b), float(s)) for b, s in samples]
    bad = [p for p in pts if not (p[0] >= 0 and p[1] > 0 and math.isfinite(p[0]) and math.isfinite(p[1]))]
    if bad:
        raise FitError(f"fit_alpha_beta: samples {bad[:3]} are not (bytes >= 0, seconds > 0); "
                       "drop failed or zero-time measurements before fitting.")
    if len({b for b, _ in pts}) < 2:
        raise FitError(f"fit_alpha_beta: needs samples at two or more distinct sizes, got sizes "
                       f"{sorted({b for b, _ in pts})}; measure a small and a large message at least.")
    w = [1.0 / (s * s) if relative else 1.0 for _, s in pts]
    sw = sum(w)
    sx = sum(wi * b for wi, (b, _) in zip(w, pts))
    sy = sum(wi * s for wi, (_, s) in zip(w, pts))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, pts))
    sxy = sum(wi * b * s for wi, (b, s) in zip(w, pts))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0:
        raise FitError(f"fit_alpha_beta: the time does not grow with the size (slope {slope:.3g} s/B over sizes "
                       f"{min(b for b, _ in pts):.0f}..{max(b for b, _ in pts):.0f} B); the samples are "
                       "noise-dominated "
                       "— measure larger messages (at least a few MiB) or more repetitions.")
    return AlphaBeta(alpha_s=alpha, bandwidth_Bps=1.0 / slope)


@dataclass(frozen=True)
class MeasuredCurve:
    """The measured times themselves: piecewise linear through (bytes, seconds) points, sorted by
    size; below the smallest size its time, above the largest the last segment's slope carried on.

    An α-β line is one start-up cost and one bandwidth for every size. On a CPU the bandwidth of a
    collective falls once its buffers outgrow the caches (Gloo here: 16 MiB in 11 ms, 32 MiB in
    26 ms), which no single line follows; a job that measured its own sizes can use them as they
    are (``benchmarks/model_check.py`` prints both predictions)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        pts = self.points
        if len(pts) < 2 or any(b1 <= b0 for (b0, _), (b1, _) in zip(pts, pts[1:])):
            raise ValueError(f"MeasuredCurve: needs two or more points with strictly growing sizes, got "
                             f"{[b for b, _ in pts]}; pass medians(samples) of at least two sizes.")
        if any(not (t > 0 and math.isfinite(t)) for _, t in pts):
            raise ValueError("MeasuredCurve: every time must be finite seconds > 0.")

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[float, float]]) -> "MeasuredCurve":
        """Through the median time of each measured size."""
        return cls(tuple((float(b), float(t)) for b, t in medians(list(samples))))

    def __call__(self, nbytes: int) -> float:
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and pts[i][0] < nbytes:
            i += 1
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return max(0.0, t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0))

    def to_dict(self) -> dict[str, list[list[float]]]:
        """JSON-ready: ``{"points": [[bytes, seconds], ...]}``."""
        return {"points": [[b, t] for b, t in self.points]}


def medians(samples: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """One (size, median seconds) per distinct size."""
    by: dict[float, list[float]] = {}
    for b, s in samples:
        by.setdefault(b, []).append(s)
    out = []
    for b in sorted(by):
        v = sorted(by[b])
        n = len(v)
        out.append((b, v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])))
    return out


def ring_allreduce(ranks: int, link_alpha_s: float, link_Bps: float) -> AlphaBeta:
    """A ring allreduce over links of latency ``link_alpha_s`` and bandwidth ``link_Bps``: 2(n-1)
    steps, each moving 1/n of the data, so ``2(n-1)·α + 2(n-1)/n · bytes / B`` (free on one rank)."""
    if ranks < 1:
        raise ValueError(f"ring_allreduce: ranks={ranks} must be >= 1.")
    if ranks == 1:
        return AlphaBeta(0.0, math.inf)
    steps = 2 * (ranks - 1)
    return AlphaBeta(steps * link_alpha_s, link_Bps * ranks / steps)
