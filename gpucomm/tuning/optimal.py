"""The exact best bucket boundaries for the step model (``step.py``).

Gradients are taken in the order backward makes them ready; a plan cuts that sequence into
contiguous buckets. Under gpucomm's schedule (in order, one at a time) the end of bucket k is
``E_k = max(R_k, E_{k-1}) + c(bytes_k, tensors_k)``, with ``R_k`` the ready time of the bucket's
last gradient and ``c`` the bucket's stream time (overheads plus the collective). ``E_k`` grows with
``E_{k-1}``, so the best plan of a prefix ending in a cut is made of the best plan of a shorter
prefix plus one bucket, which gives the dynamic program::

    f(0) = 0,   f(j) = min over 0 <= i < j of  max(r_j, f(i)) + c(bytes(i, j), j - i)

where ``r_j`` is the j-th ready time in ready order. ``f(n)`` is the earliest the last bucket can
end over *every* contiguous plan (exact, not a heuristic), hence the shortest predicted step,
since ``step = forward + max(backward_end, f(n)) + update``. Complexity: O(n²) evaluations of the
cost function and O(n) memory for n gradients (byte counts of a bucket come from prefix sums);
with ``cap_bytes`` the inner loop stops at the cap, O(n·m) for at most m gradients per bucket.
Among plans that end equally early, the one with the larger last bucket is returned.

With ``processor="shared"`` (CPU ranks whose cores all compute, ``step.py``) the processor never
idles until the last bucket ends, so that end is ``backward + sum of the buckets' costs`` for
every plan, and the recurrence becomes ``f(j) = min f(i) + c(bytes(i, j), j - i)``: the plan of
least total cost (one bucket, for an α-β cost), again exact and O(n²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .step import PROCESSORS, Overheads, backward_end, check_inputs, shifted_ready

__all__ = ["OptimalPlan", "optimal_plan", "ready_order", "buckets_from_cuts"]


@dataclass(frozen=True)
class OptimalPlan:
    """``order``: gradient indices in ready order; ``cuts``: end positions (exclusive) in ``order`` of
    each bucket, the last one ``len(order)``; ``buckets``: the same as lists of gradient indices, in
    launch order; ``end_s``: when the last bucket ends (seconds from the start of backward; on a
    shared processor, when backward and every bucket are done)."""

    order: tuple[int, ...]
    cuts: tuple[int, ...]
    buckets: tuple[tuple[int, ...], ...]
    end_s: float


def ready_order(ready_s: Sequence[float]) -> list[int]:
    """Gradient indices by ready time; ties put the later parameter first (backward's order, and
    ``fusion.plan_by_readiness``'s)."""
    return sorted(range(len(ready_s)), key=lambda i: (ready_s[i], -i))


def buckets_from_cuts(order: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    """Turn cut positions in ``order`` into buckets of gradient indices."""
    out, start = [], 0
    for end in cuts:
        if not start < end <= len(order):
            raise ValueError(f"buckets_from_cuts: cuts {list(cuts)} must rise strictly from 1 to {len(order)}.")
        out.append(list(order[start:end]))
        start = end
    if start != len(order):
        raise ValueError(f"buckets_from_cuts: the last cut is {start}, not {len(order)}: gradients would be left out.")
    return out


def optimal_plan(ready_s: Sequence[float], sizes: Sequence[int], cost: Callable[[int], float], *,
                 overheads: Overheads = Overheads(), cap_bytes: int | None = None,
                 processor: str = "dedicated") -> OptimalPlan:
    """The contiguous plan (in ready order) whose last bucket ends earliest (module doc).

    ``cost(nbytes)``: one collective's seconds; ``overheads``: the per-bucket costs around it (and
    the hooks' copies, which shift the ready times); ``cap_bytes``: optionally, no bucket above it
    (a single gradient larger than the cap still gets a bucket of its own); ``processor``:
    ``"dedicated"`` or ``"shared"`` (module doc)."""
    check_inputs(ready_s, sizes)
    if processor not in PROCESSORS:
        raise ValueError(f"optimal_plan: processor={processor!r}; use one of {', '.join(PROCESSORS)}.")
    shared = processor == "shared"
    n = len(sizes)
    if n == 0:
        return OptimalPlan((), (), (), 0.0)
    ready = shifted_ready(ready_s, sizes, overheads)
    order = ready_order(ready)
    r = [ready[i] for i in order]
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + sizes[i])
    f = [0.0] + [math.inf] * n
    arg = [0] * (n + 1)
    for j in range(1, n + 1):
        best, best_i = math.inf, j - 1
        for i in range(j - 1, -1, -1):
            nbytes = prefix[j] - prefix[i]
            if cap_bytes is not None and nbytes > cap_bytes and i < j - 1:
                break
            start = f[i] if shared else max(r[j - 1], f[i])
            end = start + overheads.bucket_s(nbytes, j - i) + cost(nbytes)
            if end <= best:
                best, best_i = end, i
        f[j], arg[j] = best, best_i
    cuts, j = [], n
    while j > 0:
        cuts.append(j)
        j = arg[j]
    cuts.reverse()
    end = backward_end(ready_s, sizes, overheads) + f[n] if shared else f[n]
    return OptimalPlan(tuple(order), tuple(cuts), tuple(tuple(b) for b in buckets_from_cuts(order, cuts)), end)
