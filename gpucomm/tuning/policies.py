"""How other schedulers group gradients, for comparison with the optimal plan and for predicting
published results of those systems with the same step model.

- ``capped_buckets``: fixed buckets in reverse parameter order under byte caps, gpucomm's default
  (``fusion.plan_buckets``: a gradient that would take a bucket over its limit opens the next one)
  or PyTorch DDP's (``rule="ddp"``: the gradient that crosses the limit stays in; 1 MiB first
  bucket, then 25 MiB, ``reducer.hpp``'s defaults).
- ``cycle_schedule``: Horovod's background loop of 2018 (``horovod/common/operations.cc`` at
  8318a898): every cycle (a 5 ms sleep) the ranks agree on the tensors ready everywhere, fuse them
  in order into buffers of at most the fusion threshold (64 MiB; a larger tensor goes alone) and
  run those allreduces one after another before the next cycle begins.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .step import BucketTiming, Overheads, StepPrediction, backward_end, check_inputs, shifted_ready

__all__ = ["capped_buckets", "cycle_schedule"]


def capped_buckets(sizes: Sequence[int], *, first_bytes: int = 1 << 20, cap_bytes: int = 25 << 20,
                   rule: str = "gpucomm") -> list[list[int]]:
    """Buckets of parameter indices in reverse parameter order (``sizes`` in parameter order)."""
    if rule not in ("gpucomm", "ddp"):
        raise ValueError(f"capped_buckets: rule={rule!r}; use 'gpucomm' (fusion.plan_buckets) or 'ddp' "
                         "(DDP's reducer).")
    buckets: list[list[int]] = []
    current: list[int] = []
    size, limit = 0, min(first_bytes, cap_bytes)
    for i in range(len(sizes) - 1, -1, -1):
        if rule == "gpucomm" and current and size + sizes[i] > limit:
            buckets.append(current)
            current, size, limit = [], 0, cap_bytes
        current.append(i)
        size += sizes[i]
        if rule == "ddp" and size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def cycle_schedule(ready_s: Sequence[float], sizes: Sequence[int], cost: Callable[[int], float], *,
                   cycle_s: float = 5e-3, threshold_bytes: int = 64 << 20, negotiation_s: float = 0.0,
                   overheads: Overheads = Overheads(), forward_s: float = 0.0, backward_s: float | None = None,
                   update_s: float = 0.0, phase_s: float = 0.0) -> StepPrediction:
    """Predict a step under Horovod's cycle (module doc). Each loop: sleep ``cycle_s``, agree
    (``negotiation_s``), then run the fused allreduces of everything ready, in ready order, one at a
    time. ``phase_s``: where in its cycle the loop is when backward starts."""
    check_inputs(ready_s, sizes)
    if not cycle_s > 0:
        raise ValueError(f"cycle_schedule: cycle_s={cycle_s!r} must be > 0 seconds (Horovod's cycle time).")
    ready = shifted_ready(ready_s, sizes, overheads)
    end_of_backward = backward_end(ready_s, sizes, overheads, backward_s)
    pending = sorted(range(len(sizes)), key=lambda i: (ready[i], -i))
    t = -phase_s
    timings: list[BucketTiming] = []
    busy = 0.0
    while pending:
        t += cycle_s
        if ready[pending[0]] > t:  # idle loops until the next gradient is there
            t += math.ceil((ready[pending[0]] - t) / cycle_s) * cycle_s
        t += negotiation_s
        batch = [i for i in pending if ready[i] <= t - negotiation_s]
        pending = pending[len(batch):]
        groups: list[list[int]] = []
        for i in batch:
            if groups and sum(sizes[j] for j in groups[-1]) + sizes[i] <= threshold_bytes:
                groups[-1].append(i)
            else:
                groups.append([i])
        for members in groups:
            nbytes = sum(sizes[i] for i in members)
            start = t
            t += overheads.bucket_s(nbytes, len(members)) + cost(nbytes)
            busy += t - start
            timings.append(BucketTiming(len(timings), nbytes, len(members), max(ready[i] for i in members), start, t))
    exposed = max(0.0, t - end_of_backward) if timings else 0.0
    end = max(end_of_backward, t if timings else 0.0)
    hidden = sum(max(0.0, min(b.end_s, end_of_backward) - b.start_s) for b in timings)
    return StepPrediction(step_s=forward_s + end + update_s, forward_s=forward_s, backward_s=end_of_backward,
                          update_s=update_s, comm_s=busy, exposed_s=exposed, overlap_s=hidden, buckets=tuple(timings))
