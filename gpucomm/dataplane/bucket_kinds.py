"""The kinds of gradient bucket: how one bucket's gradients reach the wire and come back.

A bucket is one of three kinds behind one interface (``Bucket``: ``fill``, ``request``,
``write_gradients``, ``zeros``, ``training_flag``), chosen once per bucket when the layout is
built (an optimizer may build its own kinds through ``GradientBuckets(make=...)``: PowerSGD's
two-phase buckets and ZeRO's reduce-scattered ones subclass ``Bucket``):

- ``ViewBucket``: the gradients end up *living* in the bucket's fusion buffer: after the
  reduction, which runs in place on the buffer (averaged by NCCL's ``AVG`` on a GPU, which like
  DDP divides before the sum; on the CPU, as Gloo only sums, scaled in place in Horovod's order:
  the prescale before the sum, the postscale after), ``p.grad`` is bound to a view of the parameter's slot
  (DDP's ``gradient_as_bucket_view``), so nothing is ever unpacked. What comes in depends on
  ``zero_grad``: ``set_to_none=False`` zeroes the buffer in place (``zero_views``) and backward
  accumulates straight into the views, so nothing is packed either (and the gradients take no
  memory beside the buffer); the default ``set_to_none=True`` frees them, autograd hands the next
  step's gradients over without a copy, and the bucket packs them in at launch, one kernel launch
  on a GPU (a gradient replaced or set to None by other code, e.g. ``model.zero_grad()``, is
  packed the same way). Measured on CPU (2 ranks, a 9.4 M-parameter MLP), freeing and packing
  once costs less than zeroing and accumulating in place, which reads and writes the buffer once
  more: 1.03x against 1.09x DDP at its best's step. ``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS=1`` makes the
  default zero them in place too (``BucketSettings.keep_views``): on a GPU that leaves no pack at
  all (no kernel, no table), the candidate default there, not yet measured. The kind for float gradients sent
  uncompressed; with the finite check the buffer is read once more for it and summed (NCCL's AVG
  would divide the slots), the division fused into the pack.
- ``FusedBucket``: one pack into the fusion buffer at launch and one unpack after (the Numba
  kernels on a GPU, ``bucket_copy``), with a cast for an fp16/bf16 wire and the finite check
  fused into the pack.
- ``CompressedBucket``: a user compressor the kernels cannot fuse: each gradient is compressed
  and the bucket is reduced as one grouped call.

Bucket 0 carries one extra element after its gradients, the *training flag* (see
``reducer.py``: ``hvd.join``), and with the finite check every bucket carries one slot per rank
(``finite.FiniteSlots``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..counters import COUNTERS
from ..reduce_op import ReduceOp
from . import cuda_calls, fusion
from .bucket_copy import BucketCopy, without_grad
from .bucket_settings import BucketSettings, fused_wire
from .grad_layout import (densified, gradient_targets, gradient_to_send, gradients_as_they_are, send_view, slot_view,
                          view_in_order)
from .handles import Handle
from .requests import Request

__all__ = ["Bucket", "CompressedBucket", "FusedBucket", "ViewBucket", "bucket_kind", "standard_bucket",
           "standard_buckets", "sub_plan"]


class Bucket:
    """One planned bucket and what happened to it this step; the kinds below say how its gradients
    reach the wire (``fill``) and come back (``write_gradients``)."""

    def __init__(self, plan: fusion.Bucket, params: list[torch.Tensor], wire: torch.dtype | None,
                 settings: BucketSettings) -> None:
        self.plan, self.params, self.wire_dtype, self.settings = plan, params, wire, settings
        self.name = f"DistributedOptimizer.bucket.{plan.index}"
        self.first = plan.index == 0  # bucket 0 carries the training flag
        self.handle: Handle | None = None
        self.early = False  # takes each gradient as its hook fires (``arrived``), not only at launch
        self.in_flight: list[torch.Tensor] = []  # gradients read by the launch, kept alive
        self.checks: torch.Tensor | None = None  # finite check: one slot per rank, reduced with the bucket
        self.contiguous = all(p.is_contiguous() for p in params)  # each travels in its own order (``gradients``)

    # -- the interface ---------------------------------------------------------------------------
    def arrived(self, p: torch.Tensor, j: int, g: torch.Tensor | None) -> None:
        """``p`` (``params[j]``)'s gradient ``g`` (its ``p.grad``) is final for this step (its hook fired);
        called only when ``early``."""

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
        """Bucket 0's reduced training flag (non-zero when some rank trained) in its first phase's
        ``result``."""
        return result[0][self.plan.numel]

    def zero_views(self, set_to_none: bool) -> list[torch.Tensor]:
        """``zero_grad(set_to_none)``: the parameters whose gradients this bucket zeroed where they
        live (none but a bound ``ViewBucket``'s, asked ``set_to_none=False`` or kept by
        ``BucketSettings.keep_views``); the others are left to the optimizer's own ``zero_grad``."""
        return []

    def reset(self) -> None:
        """Ready for the next step."""
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

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradients as a pack reads them: themselves when the parameters are contiguous and
        so are their gradients (no view per gradient), else each one's view in its travel order (zeros
        for a missing one)."""
        if self.contiguous:
            grads = gradients_as_they_are(self.params)
            if grads is not None:
                return grads
        settings = self.settings
        strides, seen = settings.strides, settings.sparse_seen
        return [send_view(p, strides[p], seen) for p in self.params]

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

    def trace(self, label: str, start: float) -> None:
        """A CPU copy's span on the timeline (GPU copies are timed by CUDA events)."""
        tracer = self.settings.tracer
        if tracer is not None and not cuda_calls.is_gpu(self.plan.device):
            tracer.span(self.name, label, start, tracer.now_us())

    def now_us(self) -> float:
        tracer = self.settings.tracer
        return tracer.now_us() if tracer is not None else 0.0


class ViewBucket(Bucket):
    """Float gradients sent uncompressed that live in the bucket's fusion buffer (see the module
    doc). A view is overwritten by the next step's backward, so a gradient kept across steps must
    be cloned (as with DDP's ``gradient_as_bucket_view``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        settings = self.settings
        gpu = cuda_calls.is_gpu(self.plan.device)
        # a GPU averages with NCCL's AVG, which divides each input before the sum for floats, or (with the
        # finite check, whose slots must stay sums) with the same division fused into the pack: no pass
        # of its own. Gloo only sums: the CPU scales in place in Horovod's order, the prescale as each
        # gradient comes in, the postscale (1/size) after the sum; so does a GPU given Horovod's
        # gradient_predivide_factor (its split is what the factor is chosen for, e.g. fp16 range).
        self.by_op = gpu and settings.average and settings.check is None
        if self.by_op:
            self.scale = self.post = 1.0
        elif gpu and settings.predivide == 1.0:
            self.scale, self.post = settings.prescale * settings.postscale, 1.0
        else:
            self.scale, self.post = settings.prescale, settings.postscale
        # with the finite check, a pack (gradients not in their views) finds the first non-finite one itself
        self.copy = BucketCopy(pack_scale=self.scale, check_finite=settings.check is not None)
        self.copy.prepare(self.plan.dtype, self.wire_dtype, self.plan.device)  # compiled now, not in backward
        self.full: torch.Tensor | None = None  # the fusion buffer (numel, + the tail)
        self.views: list[torch.Tensor] = []  # each parameter's slot, in its shape and layout
        self.pieces: list[torch.Tensor] = []  # each gradient's slot, flat (the finite check's search)
        self.bound = False  # this step's gradients were already their views (no copy)
        # CPU: each gradient goes into its slot as its hook fires (Bucket.early): the bucket's copies are
        # spread over backward, so its allreduce starts right after the last one (a GPU packs at launch,
        # one kernel for the bucket instead of one copy per gradient)
        self.early = not gpu
        self.arrived_now = [False] * len(self.params)  # which parameters are in their slots this step (CPU)
        self.arrivals = 0  # ... how many
        self.copied_now = False  # ... of which one was copied, not accumulated in place

    def _bind_buffer(self) -> None:
        """The buffer and its slot views (stable: the buffer never changes size)."""
        plan, strides = self.plan, self.settings.strides
        self.full = self.buffer()
        self.pieces = [self.full[offset : offset + n] for offset, n in zip(plan.offsets, plan.numels)]
        self.views = [slot_view(piece, p, strides[p]) for piece, p in zip(self.pieces, self.params)]

    def _all_bound(self) -> bool:
        """Every parameter trains and its gradient is its view (autograd accumulated into the buffer)."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view or not p.requires_grad:
                return False
        return True

    def arrived(self, p: torch.Tensor, j: int, g: torch.Tensor | None) -> None:
        """(CPU, ``p``'s hook; ``p`` is ``params[j]``, ``g`` its ``p.grad``) the gradient into its slot,
        scaled: in place when it is its view already, else one scaled copy into the view (which has
        ``p``'s shape and travel order, so the copy takes the gradient in whatever layout it has: no
        flat view of it is made first); zeros when it has none. Synchronous: nothing is kept alive."""
        if self.full is None:
            self._bind_buffer()
        if not self.arrivals:  # the step's first: last step's gradients go now, if zero_grad kept them
            self.in_flight = []
        view = self.views[j]
        trains = p.requires_grad
        if g is view and trains:
            if self.scale != 1.0:
                view.mul_(self.scale)
        else:
            if g is None or not trains:
                view.zero_()
            else:
                if g.is_sparse:
                    g = densified(p, g, self.settings.sparse_seen)
                torch.mul(g, self.scale, out=view) if self.scale != 1.0 else view.copy_(g)
            self.copied_now = True
        self.arrived_now[j] = True
        self.arrivals += 1

    def _copy_all_in(self) -> bool:
        """(CPU, at launch, no gradient taken yet: hooks by arrival order leave them all to the launch)
        Every gradient into its slot in one ``_foreach_copy_`` when each is a dense tensor of its own
        (not its view already, not missing) and no scale applies; False (nothing done) otherwise."""
        if self.scale != 1.0:
            return False
        views = self.views
        grads = [p.grad for p in self.params]
        for g, view in zip(grads, views):
            if g is None or g is view or g.is_sparse:
                return False
        if not all(p.requires_grad for p in self.params):
            return False
        self.in_flight = []
        torch._foreach_copy_(views, grads)  # (in every torch claimed: 2.1 has it)
        n = len(views)
        self.arrived_now = [True] * n
        self.arrivals = n
        self.copied_now = True
        return True

    def fill(self) -> list[torch.Tensor]:
        # no grad-mode context needed: neither the buffer nor a gradient requires grad
        if self.full is None:
            self._bind_buffer()
        full, numel, settings = self.full, self.plan.numel, self.settings
        tracer = settings.tracer
        start = tracer.now_us() if tracer is not None else 0.0
        checked = False  # the finite check's slot written by the pack itself
        if self.early:
            if self.arrivals < len(self.params):  # the gradients whose hooks did not fire (zeros if they have none)
                if self.arrivals or not self._copy_all_in():
                    for j, p in enumerate(self.params):
                        if not self.arrived_now[j]:
                            self.arrived(p, j, p.grad)
            self.bound = not self.copied_now
            if self.bound:
                COUNTERS.grad_bucket_views += 1
            else:
                COUNTERS.grad_bucket_packs += 1
        elif self._all_bound():
            self.bound = True
            COUNTERS.grad_bucket_views += 1
            if self.scale != 1.0:
                full[:numel].mul_(self.scale)
        else:  # the gradients are not their views: one pack (zeros for a missing gradient)
            self.bound = False
            COUNTERS.grad_bucket_packs += 1
            grads = self.gradients()
            if settings.check is not None and self.copy.checks_in_kernel(full):
                # the checked pack kernel: no second pass over the gradients to search them
                without_grad(self.copy.pack, grads, full[:numel], check_out=self.check_slots(full),
                             check_limit=settings.check.limit(full.dtype))
                checked = True
            else:  # torch ops: packed, then searched below within the check's budget
                without_grad(self.copy.pack, grads, full[:numel])
            self.in_flight = grads
        if self.first:
            full[numel : numel + 1].fill_(1)  # the training flag
        if settings.check is not None and not checked:
            settings.check.search(self.pieces, self.check_slots(full), whole=full[:numel])
        if tracer is not None:
            self.trace("MEMCPY_IN_FUSION_BUFFER", start)
        return [full]

    def request(self, tensors: list[torch.Tensor]) -> Request:
        if not self.by_op:
            return super().request(tensors)
        settings = self.settings  # averaged by the reduction itself: NCCL's AVG when no factor is left over
        return Request("allreduce", self.name, tensors, outputs=tensors, op=ReduceOp.AVERAGE,
                       prescale=1.0 / settings.predivide, postscale=settings.predivide, device=self.plan.device,
                       set_id=settings.set_id)

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        if self.full is None:
            self._bind_buffer()
        with torch.no_grad():
            if result[0] is not self.full:  # a joined rank's stand-in result: into the buffer, then bound
                self.full[: self.plan.numel].copy_(result[0][: self.plan.numel])
                self.bound = False
            if self.post != 1.0:  # the gradients only (the tail's flag and finite slots stay sums)
                self.full[: self.plan.numel].mul_(self.post)
            if self.bound:
                return  # reduced where the gradients live: nothing to write
            for p, view in zip(self.params, self.views):  # each gradient becomes its slot, averaged already
                if p.grad is not view and p.requires_grad:  # (on the CPU: one the user replaced after its hook)
                    p.grad = view
        self.bound = True

    def zero_views(self, set_to_none: bool) -> list[torch.Tensor]:
        settings = self.settings
        if (set_to_none and not settings.keep_views) or not settings.views or self.full is None \
                or not self._all_bound():
            return []
        with torch.no_grad():
            self.full[: self.plan.numel].zero_()
        return self.params

    def reset(self) -> None:
        in_flight = self.in_flight
        super().reset()
        self.in_flight = in_flight  # the gradients copied in, kept until zero_grad (release) or the next step
        if self.arrivals:
            self.arrived_now = [False] * len(self.params)
            self.arrivals = 0
        self.copied_now = False


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
        grads = self.gradients()
        numel = self.plan.numel
        full = self.buffer()
        start = self.now_us()
        COUNTERS.grad_bucket_packs += 1
        mine = self.check_slots(full)
        if mine is None:
            without_grad(self.copy.pack, grads, full[:numel])
        else:
            without_grad(self.copy.pack, grads, full[:numel], check_out=mine,
                         check_limit=settings.check.limit(full.dtype))
        if self.first:
            full[numel : numel + 1].fill_(1)  # the training flag (the buffer does not require grad)
        self.trace("MEMCPY_IN_FUSION_BUFFER", start)
        self.in_flight, self.full = grads, full
        return [full]

    def write_gradients(self, result: list[torch.Tensor]) -> None:
        strides = self.settings.strides
        targets = gradient_targets(self.params)
        start = self.now_us()
        COUNTERS.grad_bucket_unpacks += 1
        with torch.no_grad():
            views = [view_in_order(t, p, strides[p]) for t, p in zip(targets, self.params)]
            dests = [v if v is not None else torch.empty(p.numel(), dtype=p.dtype, device=p.device)
                     for v, p in zip(views, self.params)]
            self.copy.unpack(self.full[: self.plan.numel], dests)
            for t, v, d, p in zip(targets, views, dests, self.params):
                if t is not None and v is None:  # a gradient in another layout: one copy back
                    t.copy_(d.as_strided(p.shape, strides[p]))
        self.trace("MEMCPY_OUT_FUSION_BUFFER", start)

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
        seen = settings.sparse_seen
        grads = [gradient_to_send(p, seen) for p in self.params]
        self.reduced, self.contexts = [], []
        COUNTERS.grad_bucket_packs += 1
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
        COUNTERS.grad_bucket_unpacks += 1
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


VIEW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def bucket_kind(plan: fusion.Bucket, wire: torch.dtype | None, settings: BucketSettings) -> type[Bucket]:
    """Which kind a planned bucket is: its gradients live in the buffer (``ViewBucket``) when they
    are floats sent uncompressed: on a GPU when views are wanted (``GPUCOMM_GRADIENT_VIEWS``; the
    finite check is then one read of the bucket, ``finite.FirstNonFinite``); on the CPU for
    float32/float64 always (with views off, ``zero_grad`` frees them and each step copies them in,
    as a pack would). Fused when the kernels can fuse the compressor (the finite check then rides
    the pack kernel); compressed otherwise."""
    if wire is None:
        return CompressedBucket
    if wire == plan.dtype:
        if cuda_calls.is_gpu(plan.device):
            if settings.views and plan.dtype in VIEW_DTYPES:
                return ViewBucket
        elif plan.dtype in (torch.float32, torch.float64):
            return ViewBucket
    return FusedBucket


def standard_bucket(plan: fusion.Bucket, params: list[torch.Tensor], settings: BucketSettings) -> Bucket:
    """A bucket of the kind ``bucket_kind`` picks for ``plan`` with the settings' compressor."""
    wire = fused_wire(plan.dtype, settings.wire_of(plan.dtype))
    return bucket_kind(plan, wire, settings)(plan, params, wire, settings)


def standard_buckets(plans: Sequence[fusion.Bucket], trainable: Sequence[torch.Tensor],
                     settings: BucketSettings) -> list[Bucket]:
    """The buckets of ``plans`` as ``DistributedOptimizer`` builds them by default."""
    return [standard_bucket(plan, [trainable[i] for i in plan.param_indices], settings) for plan in plans]


def sub_plan(index: int, trainable: Sequence[torch.Tensor], ids: Sequence[int]) -> fusion.Bucket:
    """A bucket record numbered ``index`` for the parameters ``ids`` (indices into ``trainable``,
    one dtype and device), packed in that order."""
    numels = tuple(trainable[i].numel() for i in ids)
    offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
    first = trainable[ids[0]]
    return fusion.Bucket(index, tuple(ids), offsets, numels, sum(numels), first.dtype, first.device)
