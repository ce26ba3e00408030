"""The model of one data-parallel training step, as gpucomm schedules it.

Inputs: when each gradient becomes ready in backward (seconds from the start of backward), its
size in bytes, the buckets (lists of gradient indices), a collective cost curve ``cost(nbytes)``
(``costs.AlphaBeta`` or ``nccl.NcclModel.cost()``) and the fixed per-bucket costs (``Overheads``).

The schedule is gpucomm's (``gpucomm/dataplane/reducer.py``): buckets launch strictly in index order,
each once all its gradients are ready, one at a time on one communication stream, so bucket k
starts at ``max(ready_k, end_{k-1})`` and holds the stream for its pack, launch, collective and
unpack. Backward does not wait for communication; the step waits at its end (``synchronize``) for
the last bucket, then runs the optimizer update::

    step = forward + max(backward_end, end_last_bucket) + update

``exposed`` is the communication the step waits for after backward (``end_last - backward_end``,
or 0); ``overlap`` is the communication time hidden behind backward. Work done on the compute
thread for each gradient (the CPU path copies each gradient into its bucket as its hook fires)
delays the later gradients: ``Overheads.hook_Bps``.

``processor`` says what the communication runs on. ``"dedicated"`` (GPUs: NCCL's stream and the
NIC's DMA) lets it run beside backward without slowing it. ``"shared"`` is a CPU rank whose cores
all compute (e.g. 2 ranks x 1 thread on 2 cores): the collective's work (Gloo's copies and sums,
the loopback's kernel copies) needs the same core, which the two share equally while both have
work (processor sharing). Then no work is ever hidden: the step is forward + backward + every
bucket's cost + update whatever the plan, and ``overlap`` counts the communication done during
backward (which slowed backward by as much).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

__all__ = ["Overheads", "BucketTiming", "StepPrediction", "simulate", "PROCESSORS", "shifted_ready", "backward_end",
           "check_inputs"]


@dataclass(frozen=True)
class Overheads:
    """Fixed costs around each bucket's collective, besides the collective itself.

    ``per_bucket_s``: launch and bookkeeping of one bucket on the communication stream;
    ``per_tensor_s``: per gradient in a bucket (copy launches); ``pack_Bps`` / ``unpack_Bps``: the
    bandwidth of packing into and unpacking out of the fusion buffer on the communication stream
    (``math.inf``: free, e.g. CPU buckets whose gradients are copied in by their hooks);
    ``hook_Bps``: the bandwidth of the per-gradient copy done on the compute thread as each
    gradient arrives (``math.inf``: none)."""

    per_bucket_s: float = 0.0
    per_tensor_s: float = 0.0
    pack_Bps: float = math.inf
    unpack_Bps: float = math.inf
    hook_Bps: float = math.inf

    def __post_init__(self) -> None:
        for name in ("per_bucket_s", "per_tensor_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Overheads: {name}={getattr(self, name)!r} must be a number of seconds >= 0.")
        for name in ("pack_Bps", "unpack_Bps", "hook_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Overheads: {name}={getattr(self, name)!r} must be a bandwidth > 0 bytes/s "
                                 "(math.inf for no cost).")

    def bucket_s(self, nbytes: int, ntensors: int) -> float:
        """The stream time of one bucket apart from its collective."""
        return (self.per_bucket_s + self.per_tensor_s * ntensors + nbytes / self.pack_Bps
                + nbytes / self.unpack_Bps)

    def to_dict(self) -> dict[str, float | str]:
        return {k: ("inf" if v == math.inf else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Overheads":
        return cls(**{k: (math.inf if v == "inf" else float(v)) for k, v in d.items()})


@dataclass(frozen=True)
class BucketTiming:
    """One bucket on the communication stream: its gradients are ready at ``ready_s``, it starts at
    ``start_s`` and ends at ``end_s`` (seconds from the start of backward)."""

    index: int
    nbytes: int
    ntensors: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step (seconds). ``comm_s``: the stream's busy time; ``exposed_s`` + ``overlap_s``
    = ``comm_s``."""

    step_s: float
    forward_s: float
    backward_s: float
    update_s: float
    comm_s: float
    exposed_s: float
    overlap_s: float
    buckets: tuple[BucketTiming, ...] = field(default=())

    @property
    def overlap_fraction(self) -> float:
        """Share of the communication hidden behind backward (1.0 when there is none)."""
        return self.overlap_s / self.comm_s if self.comm_s > 0 else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["overlap_fraction"] = self.overlap_fraction
        return d


def check_inputs(ready_s: Sequence[float], sizes: Sequence[int]) -> None:
    """Raise ValueError unless ready times and sizes pair up and are valid numbers."""
    if len(ready_s) != len(sizes):
        raise ValueError(f"step model: {len(ready_s)} ready times for {len(sizes)} gradient sizes; "
                         "give one ready time per gradient.")
    bad = [i for i, t in enumerate(ready_s) if not (math.isfinite(t) and t >= 0)]
    if bad:
        raise ValueError(f"step model: ready times at {bad[:5]} are not finite seconds >= 0 (measure from the start "
                         "of backward; give a gradient that never arrived the backward end).")
    neg = [i for i, s in enumerate(sizes) if s < 0]
    if neg:
        raise ValueError(f"step model: gradient sizes at {neg[:5]} are negative byte counts.")


def shifted_ready(ready_s: Sequence[float], sizes: Sequence[int], overheads: Overheads) -> list[float]:
    """Ready times after the compute thread's own per-gradient copies (``hook_Bps``): each copy,
    done as its gradient arrives, delays every gradient that arrives later."""
    if overheads.hook_Bps == math.inf:
        return list(ready_s)
    order = sorted(range(len(ready_s)), key=lambda i: (ready_s[i], -i))  # ties: the later parameter first
    out = [0.0] * len(ready_s)
    delay = 0.0
    for i in order:
        delay += sizes[i] / overheads.hook_Bps
        out[i] = ready_s[i] + delay
    return out


def backward_end(ready_s: Sequence[float], sizes: Sequence[int], overheads: Overheads,
                 backward_s: float | None = None) -> float:
    """When backward ends: its measured end (default: the last ready time), plus the hooks' copies."""
    hooks = sum(sizes) / overheads.hook_Bps if overheads.hook_Bps != math.inf else 0.0
    return max(max(ready_s, default=0.0), backward_s if backward_s is not None else 0.0) + hooks


PROCESSORS = ("dedicated", "shared")


def simulate(ready_s: Sequence[float], sizes: Sequence[int], buckets: Sequence[Sequence[int]],
             cost: Callable[[int], float], *, overheads: Overheads = Overheads(), forward_s: float = 0.0,
             backward_s: float | None = None, update_s: float = 0.0, processor: str = "dedicated") -> StepPrediction:
    """Predict one step with the given ``buckets`` (each a list of gradient indices, in launch
    order; every gradient in exactly one). ``backward_s``: when backward ends (default: the last
    ready time after the hooks' copies). ``processor``: ``"dedicated"`` or ``"shared"`` (module doc)."""
    if processor not in PROCESSORS:
        raise ValueError(f"simulate: processor={processor!r}; use 'dedicated' (communication beside compute, "
                         "GPUs) or 'shared' (CPU ranks whose cores all compute).")
    check_inputs(ready_s, sizes)
    seen = sorted(i for b in buckets for i in b)
    if seen != list(range(len(sizes))):
        raise ValueError(f"simulate: the buckets must hold each of the {len(sizes)} gradients exactly once "
                         f"(they hold {len(seen)} entries, {len(set(seen))} distinct).")
    if any(len(b) == 0 for b in buckets):
        raise ValueError("simulate: a bucket is empty; drop it (an empty bucket would still cost a collective).")
    ready = shifted_ready(ready_s, sizes, overheads)
    end_of_backward = backward_end(ready_s, sizes, overheads, backward_s)
    if processor == "shared":
        return _shared(ready, sizes, buckets, cost, overheads, end_of_backward, forward_s, update_s)
    free, timings, busy = 0.0, [], 0.0
    for k, members in enumerate(buckets):
        nbytes = sum(sizes[i] for i in members)
        r = max(ready[i] for i in members)
        start = max(r, free)
        free = start + overheads.bucket_s(nbytes, len(members)) + cost(nbytes)
        busy += free - start
        timings.append(BucketTiming(k, nbytes, len(members), r, start, free))
    exposed = max(0.0, free - end_of_backward)
    return StepPrediction(step_s=forward_s + max(end_of_backward, free) + update_s, forward_s=forward_s,
                          backward_s=end_of_backward, update_s=update_s, comm_s=busy, exposed_s=exposed,
                          overlap_s=busy - exposed, buckets=tuple(timings))


def _shared(ready: list[float], sizes: Sequence[int], buckets: Sequence[Sequence[int]], cost: Callable[[int], float],
            overheads: Overheads, backward_work: float, forward_s: float, update_s: float) -> StepPrediction:
    """Processor sharing between backward and the communication: each runs at half speed while
    both have work. ``ready`` and ``backward_work`` are in seconds of backward alone; events are
    backward reaching a bucket's ready point or its end, and a bucket finishing."""
    nbytes = [sum(sizes[i] for i in b) for b in buckets]
    work = [overheads.bucket_s(n, len(b)) + cost(n) for n, b in zip(nbytes, buckets)]
    due = [max(ready[i] for i in b) for b in buckets]
    marks = sorted({d for d in due if 0 < d < backward_work} | {backward_work})  # backward's events
    ready_t = [0.0 if d <= 0 else None for d in due]
    t = done = 0.0
    k, left, start, running = 0, 0.0, 0.0, False
    backward_t = 0.0 if backward_work <= 0 else None
    timings: list[BucketTiming] = []
    while k < len(buckets) or done < backward_work:
        if not running and k < len(buckets) and due[k] <= done:
            running, left, start = True, work[k], t
        computing = done < backward_work
        rate = 0.5 if running and computing else 1.0
        steps = []
        if computing:
            steps.append((next(m for m in marks if m > done) - done) / rate)
        if running:
            steps.append(left / rate)
        dt = min(steps)
        t += dt
        if computing:
            done = min(backward_work, done + dt * rate)
            hit = next(m for m in marks if m >= done - 1e-12 * max(1.0, backward_work))
            if abs(hit - done) <= 1e-12 * max(1.0, backward_work):
                done = hit  # land exactly on the event, so ready points compare equal
            for j, d in enumerate(due):
                if ready_t[j] is None and d <= done:
                    ready_t[j] = t
            if done >= backward_work and backward_t is None:
                backward_t = t
        if running:
            left -= dt * rate
            if left <= 1e-12 * max(1.0, work[k]):
                timings.append(BucketTiming(k, nbytes[k], len(buckets[k]), ready_t[k], start, t))
                running, k = False, k + 1
    end = max(t, backward_t)
    comm = sum(work)
    exposed = max(0.0, end - backward_t)
    return StepPrediction(step_s=forward_s + end + update_s, forward_s=forward_s, backward_s=backward_t,
                          update_s=update_s, comm_s=comm, exposed_s=exposed, overlap_s=comm - exposed,
                          buckets=tuple(timings))
