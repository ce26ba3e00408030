"""A DistributedOptimizer's gradient buckets on their fixed schedule.

Each bucket's gradients are packed into its fusion buffer (scaled, and cast for compression, in the
same pass), and its allreduce is launched on the optimizer's own ``Schedule`` strictly in bucket
order; ``finish`` waits for them in order and unpacks each buffer into the gradients, applying the
average in the same pass. No control-plane message is sent: every rank verified the same layout
when the optimizer was built.

A bucket is one of three kinds behind one interface (``Bucket``: ``gradient_ready``, ``fill``,
``write_gradients``, ``zeros``, ``training_flag``), chosen once per bucket when the layout is
built (an optimizer may build its own kinds through ``GradientBuckets(make=...)``: PowerSGD's
two-phase buckets, ``powersgd.py``, and ZeRO's reduce-scattered ones, ``zero.py``):
- ``DirectBucket``: CPU float32/float64 gradients sent uncompressed, copied into their slots as
  their hooks fire and handed back as views of the buffer (DDP's ``gradient_as_bucket_view``);
- ``FusedBucket``: one pack into the fusion buffer at launch and one unpack after (the Numba
  kernels on a GPU, ``gpucomm.dataplane.bucket_copy``), with a cast for the built-in compressors;
- ``CompressedBucket``: a user compressor the kernels cannot fuse: each gradient is compressed and
  the bucket is reduced as one grouped call.

A gradient travels in its parameter's memory order: a ``channels_last`` gradient (or any gradient
whose elements fill one dense block) is packed and unpacked through a flat view of its memory, with
no ``.contiguous()`` copy and no temporary, and every rank packs the same order because parameters'
strides are verified alike across ranks with their shapes. A training step is a *step* of the
schedule (``Schedule.begin_step``/``end_step``): it places the step's NCCL calls among the
negotiated ones the same way on every rank (``gpucomm.dataplane.order``).

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

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..dataplane import fusion
from ..dataplane.buffers import FusionBuffers
from ..dataplane.bucket_copy import BucketCopy
from ..dataplane.handles import Handle
from ..dataplane.requests import Request
from ..dataplane.schedule import Schedule
from ..kernels.rules import CASTS
from ..reduce_op import ReduceOp
from .compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .finite_check import FiniteSlots


def wire_dtype(compression: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a bucket of ``dtype`` gradients travels in, or None when the compressor is not one
    the pack kernels can fuse (then gradients are compressed one by one)."""
    if compression in (None, NoneCompressor, Compression.none):
        return dtype
    for builtin in (FP16Compressor, BF16Compressor):
        if compression is builtin or isinstance(compression, builtin):
            wire = builtin.wire_dtype
            if not dtype.is_floating_point or dtype == wire:
                return dtype
            return wire if (dtype, wire) in CASTS else None
    return None


@dataclass(eq=False)
class BucketSettings:
    """What every bucket of one layout shares: the factors packed in and unpacked out, the
    compressor, the process set, the finite check, the fusion buffers, the layout each gradient
    travels in, and the timeline's tracer for the current step (None: no timeline)."""

    compression: Any
    prescale: float
    postscale: float
    set_id: int
    check: FiniteSlots | None
    buffers: FusionBuffers = field(default_factory=FusionBuffers)
    strides: dict = field(default_factory=dict)  # parameter -> the strides its gradient travels in
    tracer: Any = None


class Bucket:
    """One planned bucket and what happened to it this step; the kinds below say how its gradients
    reach the wire (``fill``) and come back (``write_gradients``)."""

    def __init__(self, plan: fusion.Bucket, params: list[torch.Tensor], wire: torch.dtype | None,
                 settings: BucketSettings) -> None:
        self.plan, self.params, self.wire_dtype, self.settings = plan, params, wire, settings
        self.name = f"DistributedOptimizer.bucket.{plan.index}"
        self.first = plan.index == 0  # bucket 0 carries the training flag
        self.pending = len(params)  # gradients still to arrive before the bucket is complete
        self.handle: Handle | None = None
        self.in_flight: list[torch.Tensor] = []  # gradients read by the launch, kept alive
        self.checks: torch.Tensor | None = None  # finite check: one slot per rank, reduced with the bucket

    # -- the interface ---------------------------------------------------------------------------
    def gradient_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for this step (its hook fired)."""
        self.pending -= 1

    def fill(self) -> list[torch.Tensor]:
        """This rank's part of the bucket's allreduce this step (gradients, training flag, finite slots)."""
        raise NotImplementedError

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        """After the last phase (``result``: what its collective returned): the averaged gradients
        into ``p.grad``."""
        raise NotImplementedError

    def second_phase(self, result: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """After the first phase (``result``): this rank's part of a second collective, or None when
        this bucket has one phase this step (every kind here; PowerSGD's has two)."""
        return None

    def second_zeros(self) -> list[torch.Tensor] | None:
        """A joined rank's part in the second phase (None when there is none this step)."""
        return None

    def stood_in(self, result: list[torch.Tensor]) -> None:
        """A joined rank's step ended with ``result`` (its last phase): keep what every rank must
        keep alike (PowerSGD's warm-start Q)."""

    def zeros(self) -> list[torch.Tensor]:
        """A joined rank's part in the bucket: zeros everywhere (training flag 0, finite slots 0)."""
        return [torch.zeros(self.plan.numel + self.tail(), dtype=self.wire_dtype, device=self.plan.device)]

    def training_flag(self, result: list[torch.Tensor]) -> torch.Tensor:
        """Bucket 0's reduced training flag (the sum over ranks of 1 for a training rank) in its first
        phase's ``result``."""
        return result[0][self.plan.numel]

    def reset(self) -> None:
        """Ready for the next step."""
        self.pending = len(self.params)
        self.handle = None
        self.checks = None
        self.in_flight = []

    def release(self) -> None:
        """Drop the gradients the last step sent (``zero_grad``)."""
        if self.handle is None:
            self.in_flight = []

    # -- shared by the fused kinds ---------------------------------------------------------------
    def request(self, tensors: list[torch.Tensor]) -> Request:
        return Request("allreduce", self.name, tensors, outputs=tensors, op=ReduceOp.SUM, device=self.plan.device,
                       set_id=self.settings.set_id)

    def tail(self) -> int:
        """Elements after a fused bucket's gradients: bucket 0's training flag, then (finite check)
        one slot per rank."""
        check = self.settings.check
        return self.first + (check.size if check is not None else 0)

    def buffer(self) -> torch.Tensor:
        """The bucket's fusion buffer (its slot of the shared grow-only buffers)."""
        return self.settings.buffers.get(self.plan.device, self.wire_dtype, self.plan.numel + self.tail(),
                                         slot=self.plan.index)

    def check_slots(self, full: torch.Tensor) -> torch.Tensor | None:
        """The finite check's slots in ``full`` (zeroed; this rank's is written by the pack), or None."""
        check = self.settings.check
        if check is None:
            return None
        at = self.plan.numel + self.first
        slots = full[at : at + check.size]
        slots.zero_()
        self.checks = slots
        return slots[check.rank : check.rank + 1]


class DirectBucket(Bucket):
    """CPU float32/float64 gradients sent uncompressed: each gradient is copied into its slot as
    soon as its hook fires, averaged in the same pass, and the averaged gradients are handed back
    as views of the fusion buffer (as DDP's ``gradient_as_bucket_view`` does): one pass over the
    gradients per step, where a pack and an unpack take two. A view is overwritten by the next
    step, so a gradient kept across steps must be cloned. The gradients sent stay alive until
    ``zero_grad`` (``release``), so their memory is freed right before the next backward allocates
    anew, as it would be had they stayed ``p.grad``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.full: torch.Tensor | None = None  # the fusion buffer (numel, + the tail)
        self.slots: dict = {}  # parameter -> its view of ``full``
        self.pieces: list[torch.Tensor] = []  # each gradient's slot, flat (the finite check's search)
        self.copied: set = set()  # parameters copied in this step

    def gradient_ready(self, p: torch.Tensor) -> None:
        self._copy_in(p)
        self.pending -= 1

    def _copy_in(self, p: torch.Tensor) -> None:
        if self.full is None:
            self._bind()
        if not self.copied:  # a new step: last step's gradients go now, if zero_grad did not release them
            self.in_flight = []
        g, slot = gradient_to_send(p), self.slots[p]
        settings = self.settings
        scale = settings.prescale * settings.postscale
        tracer = settings.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            if g.data_ptr() != slot.data_ptr():
                torch.mul(g, scale, out=slot) if scale != 1.0 else slot.copy_(g)
            elif scale != 1.0:  # the gradient is last step's view of this slot: average it in place
                slot.mul_(scale)
        if tracer is not None:
            tracer.span(self.name, "MEMCPY_IN_FUSION_BUFFER", start, tracer.now_us())
        self.copied.add(p)
        self.in_flight.append(g)

    def _bind(self) -> None:
        """The buffer and slot views (stable: the buffer's size never changes)."""
        plan = self.plan
        self.full = self.buffer()
        self.slots = {p: self.full[offset : offset + n].view(p.shape)
                      for p, offset, n in zip(self.params, plan.offsets, plan.numels)}
        self.pieces = [self.full[offset : offset + n] for offset, n in zip(plan.offsets, plan.numels)]

    def fill(self) -> list[torch.Tensor]:
        for p in self.params:  # the gradients whose hooks did not fire are copied now (zeros if they have none)
            if p not in self.copied:
                self._copy_in(p)
        numel = self.plan.numel
        if self.first:
            self.full[numel : numel + 1].fill_(1)  # the training flag
        mine = self.check_slots(self.full)
        if mine is not None:
            self.settings.check.search(self.pieces, mine, whole=self.full[:numel])
        return [self.full]

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        with torch.no_grad():  # averaged when copied in: each gradient becomes its slot of the buffer
            for p in self.params:
                if p.requires_grad:
                    p.grad = self.slots[p]

    def reset(self) -> None:
        in_flight = self.in_flight
        super().reset()
        self.in_flight = in_flight  # kept until zero_grad (release) or the next step's first copy
        self.copied.clear()


class FusedBucket(Bucket):
    """Packed into the fusion buffer at launch and unpacked after, each in one pass (``BucketCopy``:
    one kernel launch each way on a GPU), cast for the built-in compressors."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        settings = self.settings
        self.copy = BucketCopy(pack_scale=settings.prescale, unpack_scale=settings.postscale,
                               check_finite=settings.check is not None)
        # compiled now, when the optimizer is built, not inside the first backward
        self.copy.prepare(self.plan.dtype, self.wire_dtype, self.plan.device)
        self.full: torch.Tensor | None = None  # this step's buffer

    def fill(self) -> list[torch.Tensor]:
        settings = self.settings
        grads = [send_view(p, settings.strides[p]) for p in self.params]
        numel = self.plan.numel
        full = self.buffer()
        tracer = settings.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            mine = self.check_slots(full)
            if mine is None:
                self.copy.pack(grads, full[:numel])
            else:
                self.copy.pack(grads, full[:numel], check_out=mine, check_limit=settings.check.limit(full.dtype))
            if self.first:
                full[numel : numel + 1].fill_(1)  # the training flag
        if tracer is not None and full.device.type == "cpu":  # GPU copies are timed by CUDA events
            tracer.span(self.name, "MEMCPY_IN_FUSION_BUFFER", start, tracer.now_us())
        self.in_flight, self.full = grads, full
        return [full]

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        strides = self.settings.strides
        targets = gradient_targets(self.params)
        tracer = self.settings.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            views = [view_in_order(t, p, strides[p]) for t, p in zip(targets, self.params)]
            dests = [v if v is not None else torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                     for v, p in zip(views, self.params)]
            self.copy.unpack(self.full[: self.plan.numel], dests)
            for t, v, d, p in zip(targets, views, dests, self.params):
                if t is not None and v is None:  # a gradient in another layout: one copy back
                    t.copy_(d.as_strided(p.shape, strides[p]))
        if tracer is not None and self.plan.device.type == "cpu":
            tracer.span(self.name, "MEMCPY_OUT_FUSION_BUFFER", start, tracer.now_us())

    def reset(self) -> None:
        super().reset()
        self.full = None


class CompressedBucket(Bucket):
    """A user compressor the kernels cannot fuse: each gradient is compressed on its own and the
    bucket is reduced as one grouped call; the training flag and the finite slots travel as tensors
    of their own at the end."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reduced: list[torch.Tensor] = []  # the compressed gradients (+ flag, + finite slots)
        self.contexts: list[Any] = []  # the compressor's contexts

    def fill(self) -> list[torch.Tensor]:
        settings = self.settings
        grads = [gradient_to_send(p) for p in self.params]
        self.reduced, self.contexts = [], []
        for g in grads:
            c, ctx = settings.compression.compress(g.mul(settings.prescale) if settings.prescale != 1.0 else g)
            self.reduced.append(c.contiguous())
            self.contexts.append(ctx)
        if self.first:
            self.reduced.append(torch.ones(1, dtype=self.reduced[0].dtype, device=self.plan.device))
        check = settings.check
        if check is not None:
            checks = torch.zeros(check.size, dtype=torch.float32, device=self.plan.device)
            check.search(grads, checks[check.rank : check.rank + 1])
            self.checks = checks
            self.reduced.append(checks)
        self.in_flight = grads
        return self.reduced

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        settings = self.settings
        with torch.no_grad():
            for t, r, ctx in zip(gradient_targets(self.params), self.reduced, self.contexts):
                if t is not None:
                    averaged = settings.compression.decompress(r, ctx)
                    t.copy_(averaged.mul(settings.postscale) if settings.postscale != 1.0 else averaged)

    def zeros(self) -> list[torch.Tensor]:
        device, compression = self.plan.device, self.settings.compression
        tensors = [compression.compress(torch.zeros(p.shape, dtype=p.dtype, device=device))[0].contiguous()
                   for p in self.params]
        if self.first:
            tensors.append(torch.zeros(1, dtype=tensors[0].dtype, device=device))
        if self.settings.check is not None:
            tensors.append(torch.zeros(self.settings.check.size, dtype=torch.float32, device=device))
        return tensors

    def training_flag(self, result: list[torch.Tensor]) -> torch.Tensor:
        return result[-2 if self.settings.check is not None else -1].reshape(-1)[-1]

    def reset(self) -> None:
        super().reset()
        self.reduced, self.contexts = [], []


def bucket_kind(plan: fusion.Bucket, wire: torch.dtype | None) -> type[Bucket]:
    """Which kind a planned bucket is: direct for CPU float32/float64 gradients sent uncompressed
    (on a GPU one pack kernel per bucket and one unpack kernel write them instead), fused when the
    kernels can fuse the compressor, compressed otherwise."""
    if wire is None:
        return CompressedBucket
    if plan.device.type == "cpu" and wire == plan.dtype and plan.dtype in (torch.float32, torch.float64):
        return DirectBucket
    return FusedBucket


def standard_bucket(plan: fusion.Bucket, params: list[torch.Tensor], compression: Any,
                    settings: BucketSettings) -> Bucket:
    """A bucket of the kind ``bucket_kind`` picks for ``plan`` sent through ``compression``."""
    wire = wire_dtype(compression, plan.dtype)
    return bucket_kind(plan, wire)(plan, params, wire, settings)


def standard_buckets(plans: Sequence[fusion.Bucket], trainable: Sequence[torch.Tensor],
                     settings: BucketSettings) -> list[Bucket]:
    """The buckets of ``plans`` as ``DistributedOptimizer`` builds them by default."""
    return [standard_bucket(plan, [trainable[i] for i in plan.param_indices], settings.compression, settings)
            for plan in plans]


def sub_plan(index: int, trainable: Sequence[torch.Tensor], ids: Sequence[int]) -> fusion.Bucket:
    """A bucket record numbered ``index`` for the parameters ``ids`` (indices into ``trainable``,
    one dtype and device), packed in that order."""
    numels = tuple(trainable[i].numel() for i in ids)
    offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
    first = trainable[ids[0]]
    return fusion.Bucket(index, tuple(ids), offsets, numels, sum(numels), first.dtype, first.device)


MakeBuckets = Callable[[Sequence[fusion.Bucket], Sequence[torch.Tensor], BucketSettings], list[Bucket]]


class GradientBuckets:
    """The buckets of one layout, launched in order on ``schedule``.

    ``prescale``/``postscale``: the factors packed in and unpacked out (Horovod's average with a
    predivide factor); ``flush()``: finishes the step's launches when a caller outside backward
    needs the GPU's issue order (the optimizer's); ``tracer``: the timeline's tracer for the
    current step, set by the optimizer once per step (None: no timeline). ``make`` builds the
    buckets of the plans (default ``standard_buckets``); their indices must run 0, 1, ... in
    launch order."""

    def __init__(self, schedule: Schedule, trainable: Sequence[torch.Tensor], plans: Sequence[fusion.Bucket],
                 compression: Any, prescale: float, postscale: float, set_id: int,
                 flush: Callable[[], None] = lambda: None, check: FiniteSlots | None = None,
                 make: MakeBuckets | None = None) -> None:
        self._schedule = schedule
        self._flush = flush
        self.settings = BucketSettings(compression, prescale, postscale, set_id, check)
        self.buckets: list[Bucket] = (make or standard_buckets)(plans, trainable, self.settings)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.settings.strides.update({p: layout_of(p) for p in self.bucket_of})  # the order each gradient travels in
        self._next = 0

    @property
    def tracer(self) -> Any:
        return self.settings.tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:
        self.settings.tracer = tracer

    @property
    def in_flight(self) -> bool:
        return any(b.handle is not None for b in self.buckets)

    # -- a training step -----------------------------------------------------------------------
    def gradient_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for this step (its hook fired): its bucket takes it (a direct
        bucket copies it into its slot at once, averaged; DDP's order: the bucket is ready to send
        when its last gradient arrives); then every complete bucket whose predecessors are launched
        is launched."""
        self.bucket_of[p].gradient_ready(p)
        self.launch_ready()

    def launch_ready(self) -> None:
        """Launch every complete bucket whose predecessors are launched (hooks call this)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def launch_rest(self) -> None:
        """Launch the buckets still waiting for gradients (missing ones count as zeros)."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)

    def _launch(self, bucket: Bucket) -> None:
        self._schedule.begin_step(self._flush)  # the step's first launch opens it (then a no-op)
        bucket.handle = self._schedule.launch(bucket.request(bucket.fill()))

    def finish(self) -> list[tuple[int, int, int]]:
        """Wait for every bucket in order and write the averaged gradients into ``p.grad`` (a
        two-phase bucket's second phase is launched as soon as its first is back, in one more step
        of the schedule, and waited for in order after). With the finite check, returns what the
        ranks reported: ``(index in the set, bucket, slot value)`` for each non-zero slot (one read
        of every bucket's slots: a host sync on a GPU)."""
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
                second.append((bucket, self._schedule.launch(bucket.request(more))))
        finally:
            if second:
                self._schedule.end_step()
        for bucket, handle in second:
            bucket.write_gradients(handle.wait())
        check = self.settings.check
        if check is None:
            return []
        checked = [b for b in self.buckets if b.checks is not None]
        if not checked:
            return []
        values = torch.cat([b.checks.float() for b in checked]).tolist()
        size = check.size
        return [(i % size, checked[i // size].plan.index, int(v)) for i, v in enumerate(values) if v != 0]

    def stride_of(self, p: torch.Tensor) -> tuple[int, ...]:
        """The strides ``p``'s gradient travels in (``layout_of``; those of size-1 dimensions as 0,
        since they say nothing): verified alike across ranks."""
        return significant_strides(self.settings.strides[p], p.shape)

    def reset(self) -> None:
        self.tracer = None
        for bucket in self.buckets:
            bucket.reset()
        self._next = 0

    def release(self) -> None:
        """Drop the gradients the last step sent (``zero_grad`` calls this): a direct bucket keeps
        them until then (see ``DirectBucket``)."""
        for bucket in self.buckets:
            bucket.release()

    # -- beyond the steady state ----------------------------------------------------------------
    def reduce_once(self, params: Sequence[torch.Tensor], name: str) -> None:
        """Average ``params``' gradients now, on the schedule (every rank calls this at the same point)."""
        settings = self.settings
        grads = [gradient_to_send(p) for p in params]
        self.allreduce_now(grads, name, settings.prescale, settings.postscale)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if p.grad is None:
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
        the same point with the same requests)."""
        self._schedule.begin_step(lambda: None)
        try:
            return [self._schedule.launch(request, meta) for request, meta in requests]
        finally:
            self._schedule.end_step()

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


# ---------------------------------------------------------------------------------------------
# a gradient's way to the wire and back


def gradient_targets(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Where each parameter's averaged gradient goes: ``p.grad`` (zeros in ``p``'s layout when it
    has none, dense when it was sparse), None for a parameter frozen since the layout was agreed
    (its gradient is left alone)."""
    targets: list[torch.Tensor | None] = []
    for p in params:
        if not p.requires_grad:
            targets.append(None)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # the parameter's layout: unpacked into in place
        elif p.grad.is_sparse:
            p.grad = p.grad.to_dense()
        targets.append(p.grad)
    return targets


def send_view(p: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``p``'s gradient as a flat tensor in the memory order ``strides`` (see the module doc): a
    view of the gradient itself when it has that layout, one copy otherwise; zeros when it has none."""
    g = p.grad
    if g is None or not p.requires_grad:
        return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
    if g.is_sparse:
        g = g.to_dense()
    view = view_in_order(g, p, strides)
    if view is not None:
        return view
    laid_out = torch.empty_strided(p.shape, strides, dtype=g.dtype, device=g.device)
    laid_out.copy_(g)
    return laid_out.as_strided((p.numel(),), (1,))


def view_in_order(t: torch.Tensor | None, p: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor | None:
    """A flat view of ``t``'s memory when it is laid out in ``p``'s travel order ``strides`` (one
    dense block; the strides of size-1 dimensions do not matter), else None."""
    if t is None or t.shape != p.shape:
        return None
    if t.is_contiguous() and p.is_contiguous():
        return t.view(-1)
    if significant_strides(t.stride(), t.shape) != significant_strides(strides, p.shape):
        return None
    return t.as_strided((t.numel(),), (1,))


def layout_of(p: torch.Tensor) -> tuple[int, ...]:
    """The strides a gradient of ``p`` travels in: ``p``'s own when its elements fill one dense
    block with no overlap (contiguous, channels_last, any permutation of dims; a gradient then
    has them too, by autograd's layout contract), else contiguous strides."""
    if p.is_contiguous():
        return p.stride()
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride()) if sz != 1):
        if stride != expected:
            return torch.empty(p.shape, device="meta").stride()
        expected *= size
    return p.stride()


def significant_strides(strides: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``strides`` with those of size-1 dimensions as 0: two tensors of one shape whose significant
    strides agree lay their elements out in the same order."""
    return tuple(st if sz != 1 else 0 for st, sz in zip(strides, shape))


def gradient_to_send(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as the bucket sends it: zeros when it has none or is frozen (Horovod's rule)."""
    g = p.grad
    if g is None or not p.requires_grad:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)
    if g.is_sparse:
        g = g.to_dense()
    return g if g.is_contiguous() else g.contiguous()


__all__ = ["Bucket", "BucketSettings", "CompressedBucket", "DirectBucket", "FusedBucket", "GradientBuckets",
           "MakeBuckets", "bucket_kind", "gradient_targets", "gradient_to_send", "layout_of", "send_view",
           "standard_bucket", "standard_buckets", "sub_plan", "view_in_order", "wire_dtype"]
