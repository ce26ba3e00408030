"""A DistributedOptimizer's gradient buckets on their fixed schedule.

Each bucket's gradients are packed into its fusion buffer (scaled, and cast for compression, in the
same pass), and its allreduce is launched on the optimizer's own ``Schedule`` strictly in bucket
order; ``finish`` waits for them in order and unpacks each buffer into the gradients, applying the
average in the same pass. No control-plane message is sent: every rank verified the same layout
when the optimizer was built.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..dataplane import fusion
from ..dataplane.bucket_copy import BucketCopy
from ..dataplane.handles import Handle
from ..dataplane.requests import Request
from ..dataplane.schedule import Schedule
from ..kernels.rules import CASTS
from ..reduce_op import ReduceOp
from .compression import BF16Compressor, Compression, FP16Compressor, NoneCompressor
from .finite_check import FiniteSlots


@dataclass(eq=False)
class BucketState:
    """A planned bucket and what happened to it this step."""

    plan: fusion.Bucket
    params: list[torch.Tensor]
    wire_dtype: torch.dtype | None  # the fused buffer's dtype; None: a compressor the kernels cannot fuse
    name: str
    direct: bool = False  # gradients copied in as they arrive; averaged ones are views of the buffer
    pending: int = 0  # gradients still to arrive before the bucket is complete
    handle: Handle | None = None
    reduced: list[torch.Tensor] = field(default_factory=list)  # the fusion buffer, or the compressed gradients
    contexts: list[Any] = field(default_factory=list)  # the compressor's contexts (unfused buckets)
    in_flight: list[torch.Tensor] = field(default_factory=list)  # gradients read by the launch, kept alive
    full: torch.Tensor | None = None  # direct: the fusion buffer (numel, + the training flag in bucket 0)
    slots: dict = field(default_factory=dict)  # direct: parameter -> its view of ``full``
    copied: set = field(default_factory=set)  # direct: parameters copied in this step
    copy: BucketCopy | None = None  # fused, not direct: the pack and unpack of its layout
    checks: torch.Tensor | None = None  # finite check: one slot per rank, reduced with the bucket (this step's)
    pieces: list[torch.Tensor] = field(default_factory=list)  # direct + finite check: each gradient's slot, flat


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


class GradientBuckets:
    """The buckets of one layout, launched in order on ``schedule``.

    ``prescale``/``postscale``: the factors packed in and unpacked out (Horovod's average with a
    predivide factor); ``flush()``: finishes the step's launches when a caller outside backward
    needs the GPU's issue order (the optimizer's); ``tracer``: the timeline's tracer for the
    current step, set by the optimizer once per step (None: no timeline)."""

    def __init__(self, schedule: Schedule, trainable: Sequence[torch.Tensor], plans: Sequence[fusion.Bucket],
                 compression: Any, prescale: float, postscale: float, set_id: int,
                 flush: Callable[[], None] = lambda: None, check: "FiniteSlots | None" = None) -> None:
        self._schedule = schedule
        self._compression = compression
        self._prescale, self._postscale = prescale, postscale
        self._set_id = set_id
        self._flush = flush
        self._check = check  # the finite check (finite_check.py): each bucket carries one slot per rank
        self.tracer: Any = None
        self._buffers = fusion.FusionBuffers()
        self.buckets = [BucketState(plan, [trainable[i] for i in plan.param_indices], wire,
                                    f"DistributedOptimizer.bucket.{plan.index}", _direct(plan, wire),
                                    len(plan.param_indices))
                        for plan, wire in ((plan, wire_dtype(compression, plan.dtype)) for plan in plans)]
        for bucket in self.buckets:
            if bucket.wire_dtype is not None and not bucket.direct:
                bucket.copy = BucketCopy(pack_scale=prescale, unpack_scale=postscale, check_finite=check is not None)
                # compiled now, when the optimizer is built, not inside the first backward
                bucket.copy.prepare(bucket.plan.dtype, bucket.wire_dtype, bucket.plan.device)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._strides = {p: _layout(p) for p in self.bucket_of}  # the order each gradient travels in
        self._next = 0

    @property
    def in_flight(self) -> bool:
        return any(b.handle is not None for b in self.buckets)

    # -- a training step -----------------------------------------------------------------------
    def gradient_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is final for this step (its hook fired): a direct bucket copies it into
        its slot at once, averaged (DDP's order: the bucket is ready to send when its last gradient
        arrives); then every complete bucket whose predecessors are launched is launched."""
        bucket = self.bucket_of[p]
        if bucket.direct:
            self._copy_in(bucket, p)
        bucket.pending -= 1
        self.launch_ready()

    def _copy_in(self, bucket: BucketState, p: torch.Tensor) -> None:
        if bucket.full is None:
            self._bind(bucket)
        if not bucket.copied:  # a new step: last step's gradients go now, if zero_grad did not release them
            bucket.in_flight = []
        g, slot = _gradient_to_send(p), bucket.slots[p]
        scale = self._prescale * self._postscale
        tracer = self.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            if g.data_ptr() != slot.data_ptr():
                torch.mul(g, scale, out=slot) if scale != 1.0 else slot.copy_(g)
            elif scale != 1.0:  # the gradient is last step's view of this slot: average it in place
                slot.mul_(scale)
        if tracer is not None:
            tracer.span(bucket.name, "MEMCPY_IN_FUSION_BUFFER", start, tracer.now_us())
        bucket.copied.add(p)
        bucket.in_flight.append(g)

    def _bind(self, bucket: BucketState) -> None:
        """A direct bucket's buffer and slot views (stable: the buffer's size never changes)."""
        numel = bucket.plan.numel
        bucket.full = self._buffers.get(bucket.plan.device, bucket.wire_dtype, numel + self._tail(bucket),
                                        slot=bucket.plan.index)
        bucket.slots = {p: bucket.full[offset : offset + n].view(p.shape)
                        for p, offset, n in zip(bucket.params, bucket.plan.offsets, bucket.plan.numels)}
        bucket.pieces = [bucket.full[offset : offset + n] for offset, n in zip(bucket.plan.offsets, bucket.plan.numels)]

    def _tail(self, bucket: BucketState) -> int:
        """Elements after a fused bucket's gradients: bucket 0's training flag, then (finite check)
        one slot per rank."""
        return (bucket.plan.index == 0) + (self._check.size if self._check is not None else 0)

    def _check_slots(self, bucket: BucketState, full: torch.Tensor) -> torch.Tensor | None:
        """The finite check's slots in ``full`` (zeroed; this rank's is written by the pack), or None."""
        if self._check is None:
            return None
        at = bucket.plan.numel + (bucket.plan.index == 0)
        slots = full[at : at + self._check.size]
        slots.zero_()
        bucket.checks = slots
        return slots[self._check.rank : self._check.rank + 1]

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

    def _launch(self, bucket: BucketState) -> None:
        self._schedule.begin_step(self._flush)  # the step's first launch opens it (then a no-op)
        first = bucket.plan.index == 0
        if bucket.direct:  # the gradients whose hooks did not fire are copied now (zeros if they have none)
            for p in bucket.params:
                if p not in bucket.copied:
                    self._copy_in(bucket, p)
            if first:
                bucket.full[bucket.plan.numel : bucket.plan.numel + 1].fill_(1)  # the training flag
            mine = self._check_slots(bucket, bucket.full)
            if mine is not None:
                self._check.search(bucket.pieces, mine, whole=bucket.full[: bucket.plan.numel])
            bucket.reduced = [bucket.full]
            bucket.handle = self._schedule.launch(self._request(bucket, bucket.reduced))
            return
        if bucket.wire_dtype is not None:
            grads = [self._send_view(p) for p in bucket.params]
            numel = bucket.plan.numel
            full = self._buffers.get(bucket.plan.device, bucket.wire_dtype, numel + self._tail(bucket),
                                     slot=bucket.plan.index)
            tracer = self.tracer
            start = tracer.now_us() if tracer is not None else 0.0
            with torch.no_grad():
                mine = self._check_slots(bucket, full)
                if mine is None:
                    bucket.copy.pack(grads, full[:numel])
                else:
                    bucket.copy.pack(grads, full[:numel], check_out=mine, check_limit=self._check.limit(full.dtype))
                if first:
                    full[numel : numel + 1].fill_(1)  # the training flag
            if tracer is not None and full.device.type == "cpu":  # GPU copies are timed by CUDA events
                tracer.span(bucket.name, "MEMCPY_IN_FUSION_BUFFER", start, tracer.now_us())
            bucket.reduced = [full]
        else:  # a user compressor: compress each gradient, reduce them as one grouped call
            grads = [_gradient_to_send(p) for p in bucket.params]
            for g in grads:
                c, ctx = self._compression.compress(g.mul(self._prescale) if self._prescale != 1.0 else g)
                bucket.reduced.append(c.contiguous())
                bucket.contexts.append(ctx)
            if first:
                bucket.reduced.append(torch.ones(1, dtype=bucket.reduced[0].dtype, device=bucket.plan.device))
            if self._check is not None:
                checks = torch.zeros(self._check.size, dtype=torch.float32, device=bucket.plan.device)
                self._check.search(grads, checks[self._check.rank : self._check.rank + 1])
                bucket.checks = checks
                bucket.reduced.append(checks)
        bucket.in_flight = grads
        bucket.handle = self._schedule.launch(self._request(bucket, bucket.reduced))

    def _request(self, bucket: BucketState, tensors: list[torch.Tensor]) -> Request:
        return Request("allreduce", bucket.name, tensors, outputs=tensors, op=ReduceOp.SUM, device=bucket.plan.device,
                       set_id=self._set_id)

    def finish(self) -> list[tuple[int, int, int]]:
        """Wait for every bucket in order and write the averaged gradients into ``p.grad``. With the
        finite check, returns what the ranks reported: ``(index in the set, bucket, slot value)``
        for each non-zero slot (one read of every bucket's slots: a host sync on a GPU)."""
        for bucket in self.buckets:
            self._finish(bucket)
        if self._check is None:
            return []
        tails = [b.checks.float() for b in self.buckets if b.checks is not None]
        if not tails:
            return []
        values = torch.cat(tails).tolist()
        size = self._check.size
        checked = [b for b in self.buckets if b.checks is not None]
        return [(i % size, checked[i // size].plan.index, int(v)) for i, v in enumerate(values) if v != 0]

    def _finish(self, bucket: BucketState) -> None:
        assert bucket.handle is not None
        bucket.handle.wait()
        targets = []
        for p in bucket.params if not bucket.direct else ():
            if not p.requires_grad:
                targets.append(None)  # frozen since the layout was agreed: leave its gradient alone
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # the parameter's layout: unpacked into in place
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            targets.append(p.grad)
        tracer = self.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        with torch.no_grad():
            if bucket.direct:  # averaged when copied in: each gradient becomes its slot of the buffer
                for p in bucket.params:
                    if p.requires_grad:
                        p.grad = bucket.slots[p]
            elif bucket.wire_dtype is not None:
                views = [self._view_in_order(t, p) for t, p in zip(targets, bucket.params)]
                dests = [v if v is not None else torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                         for v, p in zip(views, bucket.params)]
                bucket.copy.unpack(bucket.reduced[0][:bucket.plan.numel], dests)
                for t, v, d, p in zip(targets, views, dests, bucket.params):
                    if t is not None and v is None:  # a gradient in another layout: one copy back
                        t.copy_(d.as_strided(p.shape, self._strides[p]))
            else:
                for t, r, ctx in zip(targets, bucket.reduced, bucket.contexts):
                    if t is not None:
                        averaged = self._compression.decompress(r, ctx)
                        t.copy_(averaged.mul(self._postscale) if self._postscale != 1.0 else averaged)
        if tracer is not None and bucket.plan.device.type == "cpu" and not bucket.direct:
            tracer.span(bucket.name, "MEMCPY_OUT_FUSION_BUFFER", start, tracer.now_us())

    def _send_view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as a flat tensor in ``p``'s memory order (see the module doc): a view of
        the gradient itself when it has ``p``'s layout, one copy otherwise; zeros when it has none."""
        g = p.grad
        if g is None or not p.requires_grad:
            return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        if g.is_sparse:
            g = g.to_dense()
        view = self._view_in_order(g, p)
        if view is not None:
            return view
        laid_out = torch.empty_strided(p.shape, self._strides[p], dtype=g.dtype, device=g.device)
        laid_out.copy_(g)
        return laid_out.as_strided((p.numel(),), (1,))

    def stride_of(self, p: torch.Tensor) -> tuple[int, ...]:
        """The strides ``p``'s gradient travels in (``_layout``; those of size-1 dimensions as 0,
        since they say nothing): verified alike across ranks."""
        return _significant(self._strides[p], p.shape)

    def _view_in_order(self, t: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor | None:
        """A flat view of ``t``'s memory when it is laid out like ``p`` (one dense block in ``p``'s
        order; the strides of size-1 dimensions do not matter), else None."""
        if t is None or t.shape != p.shape:
            return None
        if t.is_contiguous() and p.is_contiguous():
            return t.view(-1)
        if _significant(t.stride(), t.shape) != _significant(self._strides[p], p.shape):
            return None
        return t.as_strided((t.numel(),), (1,))

    def reset(self) -> None:
        self.tracer = None
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.handle = None
            bucket.checks = None
            bucket.reduced, bucket.contexts = [], []
            bucket.copied.clear()
            if not bucket.direct:
                bucket.in_flight = []
        self._next = 0

    def release(self) -> None:
        """Drop the gradients the last step sent (``zero_grad`` calls this): a direct bucket keeps
        them until then, so their memory is freed right before the next backward allocates anew,
        as it would be had they stayed ``p.grad`` (the allocator reuses it instead of faulting in
        fresh pages)."""
        for bucket in self.buckets:
            if bucket.handle is None:
                bucket.in_flight = []

    # -- beyond the steady state ----------------------------------------------------------------
    def reduce_once(self, params: Sequence[torch.Tensor], name: str) -> None:
        """Average ``params``' gradients now, on the schedule (every rank calls this at the same point)."""
        grads = [_gradient_to_send(p) for p in params]
        device = grads[0].device
        request = Request("allreduce", name, grads, outputs=grads, op=ReduceOp.SUM, prescale=self._prescale,
                          postscale=self._postscale, device=device, set_id=self._set_id)
        self._schedule.begin_step(lambda: None)  # a step of its own: placed among negotiated work alike
        try:
            handle = self._schedule.launch(request)
        finally:
            self._schedule.end_step()
        handle.wait()
        with torch.no_grad():
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g
                elif p.grad is not g:
                    p.grad.copy_(g)

    def stand_in_step(self) -> bool:
        """One step of zeros on the schedule, for a rank that joined; False when no rank trained in
        it (every rank has joined), True when the others still train."""
        if not self.buckets:  # nothing dense to stand in for (sparse reductions cannot be stood in for)
            return False
        launched = []
        self._schedule.begin_step(lambda: None)
        try:  # every bucket's zeros go out inside the step, and nothing waits inside it: a joined rank's
            # stand-ins for negotiated collectives wait for the step's end, which must come
            for bucket in self.buckets:
                tensors = self._zeros(bucket)
                launched.append((bucket, tensors, self._schedule.launch(self._request(bucket, tensors))))
        finally:
            self._schedule.end_step()
        for _, _, handle in launched:
            handle.wait()
        bucket, tensors, _ = launched[0]  # bucket 0: the training flag
        return float(self._training_flag(bucket, tensors)) != 0.0

    def _zeros(self, bucket: BucketState) -> list[torch.Tensor]:
        """A joined rank's part in ``bucket``: zeros everywhere (training flag 0, finite slots 0)."""
        device, first = bucket.plan.device, bucket.plan.index == 0
        if bucket.wire_dtype is not None:
            return [torch.zeros(bucket.plan.numel + self._tail(bucket), dtype=bucket.wire_dtype, device=device)]
        tensors = [self._compression.compress(torch.zeros(p.shape, dtype=p.dtype, device=device))[0].contiguous()
                   for p in bucket.params]
        if first:
            tensors.append(torch.zeros(1, dtype=tensors[0].dtype, device=device))
        if self._check is not None:
            tensors.append(torch.zeros(self._check.size, dtype=torch.float32, device=device))
        return tensors

    def _training_flag(self, bucket: BucketState, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Bucket 0's reduced training flag (the sum over ranks of 1 for a training rank)."""
        if bucket.wire_dtype is not None:
            return tensors[0][bucket.plan.numel]
        return tensors[-2 if self._check is not None else -1].reshape(-1)[-1]


def _direct(plan: fusion.Bucket, wire: torch.dtype | None) -> bool:
    """CPU buckets of float32/float64 gradients sent uncompressed are *direct*: each gradient is
    copied into its slot as soon as its hook fires, averaged in the same pass, and the averaged
    gradients are handed back as views of the fusion buffer (as DDP's ``gradient_as_bucket_view``
    does): one pass over the gradients per step, where a pack and an unpack take two. A view is
    overwritten by the next step, so a gradient kept across steps must be cloned. On GPU one pack
    kernel per bucket and one unpack kernel write them instead."""
    return plan.device.type == "cpu" and wire == plan.dtype and plan.dtype in (torch.float32, torch.float64)


def _layout(p: torch.Tensor) -> tuple[int, ...]:
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


def _significant(strides: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``strides`` with those of size-1 dimensions as 0: two tensors of one shape whose significant
    strides agree lay their elements out in the same order."""
    return tuple(st if sz != 1 else 0 for st, sz in zip(strides, shape))


def _gradient_to_send(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as the bucket sends it: zeros when it has none or is frozen (Horovod's rule)."""
    g = p.grad
    if g is None or not p.requires_grad:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)
    if g.is_sparse:
        g = g.to_dense()
    return g if g.is_contiguous() else g.contiguous()


__all__ = ["BucketState", "GradientBuckets", "wire_dtype"]
