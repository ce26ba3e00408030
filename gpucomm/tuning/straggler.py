"""Waiting for the slowest rank: the straggler term of a synchronous data-parallel step.

A synchronous step ends only once every rank's gradients are in, so it lasts as long as the
slowest rank's. If each rank's step varies on its own around the single-device step ``T`` with a
coefficient of variation ``cv`` (``T·(1 + cv·z)``, ``z`` standard normal, independent across ranks
and steps: the sum of many small independent delays), the job's step is on average
``cv·T·E[max of n z]`` longer than one rank's (``Stragglers(cv).delay_s(T, n)``). The factor
``E[max of n z]`` (``expected_max_normal``) grows like ``√(2 ln n)``: 0 at one rank, 0.56 at 2,
1.03 at 4, 1.77 at 16, 2.59 at 128, 3.04 at 512. It is the same for every model; ``cv`` belongs to
the cluster (machines, OS, framework and their noise), not to the model. The delay adds to the
step the step model predicts for identical ranks (``step.simulate``, ``policies.cycle_schedule``).

The mechanism is the classic one of synchronous SGD (Chen et al., "Revisiting Distributed
Synchronous SGD", arXiv 1604.00981: the synchronous step waits for its stragglers); Horovod's
timeline shows it as the negotiation phase: "you can see which workers were early and which were
late" (horovod/horovod ``docs/timeline.md`` at 8318a898, the commit of the 512-GPU benchmark).
``cv`` is rarely published; ``fit_cv`` finds it by least squares from published efficiencies of
the same cluster, so that it can then be checked on other rank counts of that cluster.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

__all__ = ["expected_max_normal", "Stragglers", "fit_cv"]

_X_MAX = 10.0  # Φ(10)^n differs from 1 by < 1e-20 n: the integrand is 0 beyond it for any rank count here
_STEPS = 20_000


def _phi_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one): ``∫₀^∞ 1 - Φ(x)ⁿ - Φ(-x)ⁿ dx``,
    by the trapezoid rule on [0, 10] (error below 1e-8)."""
    try:
        ranks = operator.index(n)  # int, numpy integers; not floats or bools-as-floats
    except TypeError:
        ranks = 0
    if isinstance(n, bool) or ranks < 1:
        raise ValueError(f"expected_max_normal: n={n!r} must be a whole number of ranks >= 1.")
    return _expected_max_normal(ranks)


@lru_cache(maxsize=256)
def _expected_max_normal(n: int) -> float:
    if n == 1:
        return 0.0
    h = _X_MAX / _STEPS

    def f(x: float) -> float:
        return 1.0 - _phi_cdf(x) ** n - _phi_cdf(-x) ** n

    return h * (0.5 * f(0.0) + sum(f(k * h) for k in range(1, _STEPS)) + 0.5 * f(_X_MAX))


@dataclass(frozen=True)
class Stragglers:
    """Per-rank step-time noise with coefficient of variation ``cv`` (module doc): a synchronous
    step of ``ranks`` ranks waits ``cv · step_s · E[max of ranks normals]`` for its slowest rank."""

    cv: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ValueError(f"Stragglers: cv={self.cv!r} must be a finite fraction >= 0 of the step "
                             "(0: every rank takes exactly the single-device step).")

    def delay_s(self, step_s: float, ranks: int) -> float:
        """Seconds the step waits for its slowest rank, ``step_s`` being one device's step."""
        if not (math.isfinite(step_s) and step_s >= 0):
            raise ValueError(f"Stragglers.delay_s: step_s={step_s!r} must be finite seconds >= 0.")
        if self.cv == 0:
            return 0.0
        return self.cv * step_s * expected_max_normal(ranks)


def fit_cv(rows: Iterable[tuple[float, int, float]]) -> float:
    """The ``cv`` that best explains published efficiencies of one cluster.

    Each row is ``(relative_step, ranks, efficiency)``: the step the model predicts without
    stragglers over the single-device step, the ranks, and the published efficiency (single-device
    step over the job's). Then ``1 / efficiency = relative_step + cv · E[max of ranks normals]``,
    and ``cv`` is its least-squares solution through the origin (clamped at 0: the model's step
    is already longer than the published one)."""
    num = den = 0.0
    count = 0
    for relative, ranks, efficiency in rows:
        if not (relative > 0 and 0 < efficiency <= 1.5 and math.isfinite(relative)):
            raise ValueError(f"fit_cv: row ({relative!r}, {ranks!r}, {efficiency!r}) needs a relative step > 0 and "
                             "an efficiency in (0, 1.5].")
        e = expected_max_normal(ranks)
        num += (1.0 / efficiency - relative) * e
        den += e * e
        count += 1
    if count == 0 or den == 0:
        raise ValueError("fit_cv: needs at least one row with more than one rank (one rank never waits for another).")
    return max(0.0, num / den)
