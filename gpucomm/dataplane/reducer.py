"""The reducer: a DistributedOptimizer's gradient buckets on their fixed schedule.

A gradient hook does index work only (``gradient_ready``: one count down; or, hooked by arrival
order, a C call that notes the arrival, and one Python hook per bucket: ``last_arrived``); when a bucket is
complete and every earlier bucket has been launched, the bucket's allreduce is launched on the
optimizer's own ``Schedule``, strictly in bucket order: its gradients are already in its fusion
buffer when they live there (``bucket_kinds.ViewBucket``), else packed in one pass (scaled, and
cast for compression). ``finish`` waits for the buckets in order (on a GPU: one done event and one
wait of the caller's stream for the whole step, ``completion.py``) and hands each bucket its
result (a view bucket has nothing to write; the others unpack, applying the average in the same
pass). No control-plane message is sent: every rank verified the same layout when the optimizer
was built.

The bucket kinds are ``bucket_kinds.py``'s; an optimizer may build its own through
``GradientBuckets(make=...)`` (PowerSGD's two-phase buckets, ZeRO's reduce-scattered ones). A
training step is a *step* of the schedule (``Schedule.begin_step``/``end_step``): it places the
step's NCCL calls among the negotiated ones the same way on every rank (``order.py``).

Joined ranks (``hvd.join``): bucket 0 carries one extra element, a *training flag*: 1 from a rank
that trains this step, 0 from a rank that stands in with zeros. A joined rank runs the schedule
with zeros and reads the reduced flag of bucket 0: when it is 0, no rank trained, so every rank has
joined and the stand-in stops (DDP's join reduces the same count, in a collective of its own).

Two phases: a bucket may need a second collective that depends on the first one's result
(PowerSGD: P = M Q is reduced, orthogonalised, then Q = M^T P is reduced). The first phases are
launched as today (in bucket order, while backward runs); ``finish`` then waits for them in order
and launches each bucket's second phase as soon as its first is back, in one more step of the
schedule, and waits for the second phases in order. Both orders depend only on the agreed layout,
so every rank issues the same collectives in the same order; a joined rank stands in for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..backends.nccl import connects_lazily
from ..counters import COUNTERS
from ..reduce_op import ReduceOp
from . import activity, cuda_calls, fusion
from .bucket_kinds import Bucket, standard_buckets
from .bucket_settings import BucketSettings
from .grad_layout import gradient_to_send, layout_of, significant_strides
from .handles import Handle
from .requests import Request

if TYPE_CHECKING:  # the optimizer hands its schedule in; the reducer never builds one
    from .schedule import Schedule

__all__ = ["GradientBuckets", "MakeBuckets"]


def _nonzero_slots(values: list[float], where: list[int], size: int) -> list[tuple[int, int, int]]:
    """``(index in the set, bucket, slot value)`` of each non-zero finite-check slot (``values``: the
    buckets' slots in order, ``size`` per bucket; ``where``: those buckets' indices)."""
    return [(i % size, where[i // size], int(v)) for i, v in enumerate(values) if v != 0]

MakeBuckets = Callable[[Sequence[fusion.Bucket], Sequence[torch.Tensor], BucketSettings], list[Bucket]]


class GradientBuckets:
    """The buckets of one layout, launched in order on ``schedule``.

    ``settings``: what the buckets share (``bucket_settings.BucketSettings``); ``flush()``: finishes
    the step's launches when a caller outside backward needs the GPU's issue order (the
    optimizer's); ``make`` builds the buckets of the plans (default ``standard_buckets``); their
    indices must run 0, 1, ... in launch order."""

    def __init__(self, schedule: "Schedule", trainable: Sequence[torch.Tensor], plans: Sequence[fusion.Bucket],
                 settings: BucketSettings, flush: Callable[[], None] = lambda: None,
                 make: MakeBuckets | None = None) -> None:
        self._schedule = schedule
        self._flush = flush
        self.settings = settings
        # the order each gradient travels in, known before the buckets bind their views
        settings.strides.update({p: layout_of(p) for plan in plans for p in (trainable[i] for i in plan.param_indices)})
        self.buckets: list[Bucket] = (make or standard_buckets)(plans, trainable, settings)
        # id(p) -> (its bucket's index, its place in that bucket): what a hook looks up (a tensor's hash is
        # a Python call; an int's is not)
        self.slot_of = {id(p): (k, j) for k, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._sizes = [len(b.params) for b in self.buckets]
        self._pending = list(self._sizes)  # gradients each bucket still waits for this step
        self._next = 0
        # Arrival order (the optimizer's choice, ``by_order``): only the gradient that came last to each bucket
        # in a recorded step has a Python hook (``last_arrived``); the others' hooks are their bucket's
        # ``arrivals.append`` (a C call: no Python frame), counted when that last one comes.
        self.arrivals: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        self.by_order = False
        self._last: list[int | None] = [None] * len(self.buckets)  # (per-gradient hooks) who completed each bucket
        self._first: list[int | None] = [None] * len(self.buckets)  # ... and who came first to it
        self._fired = [0] * len(self.buckets)  # (by order) how often each bucket's last hook fired this step
        self._in_backward = False
        self._pending_checks: list[tuple[int, list[int], Any]] = []  # finite slots on their way to the host

    @property
    def tracer(self) -> Any:
        return self.settings.tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:
        self.settings.tracer = tracer

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is in one of the buckets."""
        return id(p) in self.slot_of

    @property
    def in_flight(self) -> bool:
        return any(b.handle is not None for b in self.buckets)

    # -- a training step -----------------------------------------------------------------------
    def gradient_ready(self, p: torch.Tensor, g: torch.Tensor | None, slot: tuple[int, int]) -> None:
        """``p``'s gradient ``g`` (``p.grad``, as its hook read it) is final for this step; ``slot`` is
        ``slot_of[id(p)]`` (the hook looked it up). Index work only (on the CPU the gradient also goes
        into its slot now, spreading the bucket's copies over backward). A bucket is ready to send when
        its last gradient arrives (DDP's order); then every complete bucket whose predecessors are
        launched is launched."""
        k, j = slot
        bucket = self.buckets[k]
        if bucket.early:  # a CPU bucket takes the gradient into its slot now (``bucket_kinds.ViewBucket``)
            bucket.arrived(p, j, g)
        pending = self._pending
        pending[k] -= 1
        if pending[k] == self._sizes[k] - 1:
            self._first[k] = j
        if not pending[k]:
            self._last[k] = j
            if k == self._next:
                self.launch_ready()

    def launch_ready(self) -> None:
        """Launch every complete bucket whose predecessors are launched (hooks call this)."""
        buckets, pending = self.buckets, self._pending
        while self._next < len(buckets) and not pending[self._next]:
            self._launch(buckets[self._next])
            self._next += 1

    # -- hooks by arrival order ------------------------------------------------------------------
    def arrival_order(self) -> tuple[list[int], list[int]] | None:
        """(after a step of per-gradient hooks, before ``reset``) Which parameter's gradient came first to
        each bucket and which completed it (their indices in the bucket), or None when some bucket was not
        completed by its hooks (a gradient that did not come: an unused parameter, ``no_sync``, a hook run
        by hand)."""
        last = self._last
        return None if None in last else (list(self._first), list(last))

    def last_arrived(self, k: int) -> bool:
        """(by order: the hook of bucket ``k``'s last gradient in the recorded order) Launch, in bucket
        order, every bucket whose last gradient has come and whose other gradients all have
        (``arrivals``); a bucket whose others have not (the order changed) waits for ``launch_rest``.
        False when this hook fired twice in the step."""
        fired = self._fired
        fired[k] += 1
        if fired[k] > 1:
            return False
        buckets, arrivals, sizes = self.buckets, self.arrivals, self._sizes
        while self._next < len(buckets):
            n = self._next
            if not fired[n] or len(arrivals[n]) != sizes[n] - 1:
                break
            self._launch(buckets[n])
            self._next = n + 1
        return True

    def arrival_verdict(self) -> str:
        """(by order, before ``launch_rest``) ``"kept"``: every bucket was launched by its last hook with
        each of its other gradients come once; ``"changed"``: some bucket was not (the order of
        backward changed, or a gradient did not come); ``"twice"``: some gradient came twice this
        step (backward ran twice, as ``backward_passes_per_step`` forbids); ``"raised"``: a last hook
        fired twice, and said so then."""
        if any(fired > 1 for fired in self._fired):
            return "raised"
        for k, got in enumerate(self.arrivals):
            if len(got) > self._sizes[k] - 1 or len(set(map(id, got))) != len(got):
                return "twice"
        return "kept" if self._next == len(self.buckets) else "changed"

    def arrivals_pending(self) -> bool:
        """(by order) Some gradient came since the step's reset (what a per-gradient hook's flag says)."""
        return any(self.arrivals) or any(self._fired)

    def mark_arrivals(self) -> list[int]:
        """How many arrivals each bucket holds now (``no_sync`` drops those after its mark)."""
        return [len(got) for got in self.arrivals]

    def drop_arrivals_since(self, marks: list[int]) -> None:
        """Forget the arrivals after ``marks`` (gradients accumulated locally inside ``no_sync``)."""
        for got, mark in zip(self.arrivals, marks):
            del got[mark:]

    def launch_rest(self) -> None:
        """Launch the buckets still waiting for gradients (missing ones count as zeros)."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)

    def _launch(self, bucket: Bucket) -> None:
        self._schedule.begin_step(self._flush)  # the step's first launch opens it (then a no-op)
        bucket.handle = self._schedule.launch(bucket.request(bucket.fill()), per_step=True)

    def begin_backward(self) -> None:
        """(the step's first gradient hook) A backward with this reducer's hooks runs: a caller
        blocked on a control round meanwhile does not poll (it would hold the GIL the hooks need)."""
        if not self._in_backward:
            self._in_backward = True
            activity.backward_started()

    def end_backward(self) -> None:
        """(autograd's final callback, or the step's reset) The backward has ended."""
        if self._in_backward:
            self._in_backward = False
            activity.backward_ended()

    def finish(self, step: int = 0) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """Wait for every bucket in order and write the averaged gradients into ``p.grad`` (a
        two-phase bucket's second phase is launched as soon as its first is back, in one more step
        of the schedule, and waited for in order after). With the finite check, returns what the
        ranks reported, per step: ``(step, [(index in the set, bucket, slot value) for each non-zero
        slot])``: this ``step``'s on the CPU and in ``"raise"`` mode (one read of every bucket's
        slots: a host sync on a GPU), else those of earlier steps whose copy to the host has arrived
        (``check_reports``)."""
        second: list[tuple[Bucket, Handle]] = []
        try:
            for bucket in self.buckets:
                assert bucket.handle is not None
                result = bucket.handle.wait()
                more = bucket.second_phase(result)
                if more is None:
                    bucket.write_gradients(result)
                    continue
                if not second:
                    self._schedule.begin_step(lambda: None)
                second.append((bucket, self._schedule.launch(bucket.request(more), per_step=True)))
        finally:
            if second:
                self._schedule.end_step()
        for bucket, handle in second:
            bucket.write_gradients(handle.wait())
        check = self.settings.check
        if check is None:
            return []
        check.step_done()
        checked = [b for b in self.buckets if b.checks is not None]
        if not checked:
            return self.check_reports()
        values = torch.cat([b.checks.float() for b in checked])
        where = [b.plan.index for b in checked]
        if check.deferred and cuda_calls.is_gpu(values.device):
            earlier = self.check_reports()  # read at the next step: this copy has only just been queued
            self._pending_checks.append((step, where, cuda_calls.calls().read_later(values)))
            return earlier
        return self.check_reports() + [(step, _nonzero_slots(values.tolist(), where, check.size))]

    def check_reports_pending(self) -> int:
        """How many steps' finite-check slots are still on their way to the host (a GPU's)."""
        return len(self._pending_checks)

    def check_reports(self, wait: bool = False) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """The finite check's reports of earlier steps whose slots have reached the host (all of
        them, waiting, with ``wait``: before a new layout, or at the optimizer's close)."""
        reports, calls, size = [], cuda_calls.calls(), self.settings.check.size if self.settings.check else 0
        while self._pending_checks:
            step, where, token = self._pending_checks[0]
            values = calls.read_now(token) if wait else calls.read_if_done(token)
            if values is None:
                break
            self._pending_checks.pop(0)
            reports.append((step, _nonzero_slots(values.tolist(), where, size)))
        return reports

    def stride_of(self, p: torch.Tensor) -> tuple[int, ...]:
        """The strides ``p``'s gradient travels in (``layout_of``; those of size-1 dimensions as 0,
        since they say nothing): verified alike across ranks."""
        return significant_strides(self.settings.strides[p], p.shape)

    def reset(self) -> None:
        self.tracer = None
        for bucket in self.buckets:
            bucket.reset()
        self._pending[:] = self._sizes
        self._next = 0
        n = len(self.buckets)
        self._last = [None] * n
        self._first = [None] * n
        if self.by_order:
            for got in self.arrivals:
                got.clear()
            self._fired = [0] * n
        self.end_backward()

    def release(self) -> None:
        """Drop the gradients the last step sent (``zero_grad`` calls this)."""
        for bucket in self.buckets:
            bucket.release()

    def zero_views(self, set_to_none: bool) -> set:
        """``zero_grad(set_to_none=False)``, or the default with ``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS=1``: zero
        the gradients that live in their buckets, where they live (one op per bucket); returns those
        parameters (their ``p.grad`` stays bound to the buffer). Otherwise ``set_to_none``: none (the
        optimizer frees them all)."""
        kept: set = set()
        for bucket in self.buckets:
            kept.update(bucket.zero_views(set_to_none))
        return kept

    # -- beyond the steady state ----------------------------------------------------------------
    def reduce_once(self, params: Sequence[torch.Tensor], name: str) -> None:
        """Average ``params``' gradients now, on the schedule (every rank calls this at the same point). A
        sparse one is averaged densified and becomes that (``settings.sparse_seen`` is told)."""
        settings = self.settings
        grads = [gradient_to_send(p, settings.sparse_seen) for p in params]
        self.allreduce_now(grads, name, settings.prescale, settings.postscale)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if p.grad is None or p.grad.is_sparse:
                    p.grad = g
                elif p.grad is not g:
                    p.grad.copy_(g)

    def allreduce_now(self, tensors: list[torch.Tensor], name: str, prescale: float = 1.0,
                      postscale: float = 1.0) -> None:
        """Sum ``tensors`` in place across the set now, on the schedule, in a step of its own (every
        rank calls this at the same point): placed among negotiated work alike."""
        request = Request("allreduce", name, tensors, outputs=tensors, op=ReduceOp.SUM, prescale=prescale,
                          postscale=postscale, device=tensors[0].device, set_id=self.settings.set_id)
        self.launch_now([(request, None)])[0].wait()

    def launch_now(self, requests: Sequence[tuple[Request, dict | None]]) -> list[Handle]:
        """Launch ``requests`` (each with the metadata a coordinator would add, or None) in this order
        on the schedule, in a step of their own, and return their handles (every rank calls this at
        the same point with the same requests). Each completes on its own (it may be waited for
        alone, e.g. a layer's parameter allgather before its forward)."""
        self._schedule.begin_step(lambda: None)
        try:
            return [self._schedule.launch(request, meta) for request, meta in requests]
        finally:
            self._schedule.end_step()

    def warm_up(self) -> None:
        """One zero-filled pass of the layout's first phases, now, at a collective point (every rank
        calls this right after agreeing on the layout): a communicator that connects its peers
        lazily (NCCL >= 2.22 unless ``NCCL_RUNTIME_CONNECT=0``) connects them here, for the
        collectives and sizes the steps will run, instead of blocking a backward hook on one rank
        until the others reach the same bucket."""
        if not any(cuda_calls.is_gpu(b.plan.device) for b in self.buckets) or not connects_lazily():
            return
        handles = self.launch_now([(bucket.request(bucket.zeros()), None) for bucket in self.buckets])
        for handle in handles:
            handle.wait()
        COUNTERS.warmup_steps += 1

    def stand_in_step(self, write: bool = False) -> bool:
        """One step of zeros on the schedule, for a rank that joined; False when no rank trained in
        it (every rank has joined), True when the others still train. Two-phase buckets stand in for
        both phases, as the training ranks run them. ``write``: when some rank trained, hand each
        bucket its result as a training step would (``write_gradients``; ZeRO's shards step on it)."""
        if not self.buckets:  # nothing dense to stand in for (sparse reductions cannot be stood in for)
            return False
        # every bucket's zeros go out inside a step, and nothing waits inside it: a joined rank's
        # stand-ins for negotiated collectives wait for the step's end, which must come
        launched = self.launch_now([(bucket.request(bucket.zeros()), None) for bucket in self.buckets])
        results = [handle.wait() for handle in launched]
        trained = float(self.buckets[0].training_flag(results[0])) != 0.0
        seconds = [(bucket, bucket.second_zeros()) for bucket in self.buckets]
        seconds = [(bucket, zeros) for bucket, zeros in seconds if zeros is not None]
        if seconds:
            handles = self.launch_now([(bucket.request(zeros), None) for bucket, zeros in seconds])
            last = dict(zip((id(b) for b, _ in seconds), (h.wait() for h in handles)))
            results = [last.get(id(b), r) for b, r in zip(self.buckets, results)]
        for bucket, result in zip(self.buckets, results):
            bucket.stood_in(result)
            if write and trained:
                bucket.write_gradients(result)
        return trained
