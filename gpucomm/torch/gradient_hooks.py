"""``DistributedOptimizer``'s gradient hooks: each trainable parameter's post-accumulate-grad hook
hands its gradient to its bucket (which launches once complete), and the step's backward is
followed from its first hook to autograd's final callback.

What the hooks do between backward and ``synchronize()``: open the step on the schedule at the
step's first gradient, count ``backward_passes_per_step``, time the gradients for the first re-cut
and for autotune, and launch what is left of the step when a caller outside backward needs the
GPU's issue order (``_flush_step``); ``no_sync()`` leaves the gradients to accumulate locally.
Kept apart from the step's reduction (``distributed_steps.py``): they run on autograd's threads,
under the optimizer's lock.

Hooks by arrival order (``_settle_hooks``): once a step's gradients all came through their hooks, only
each bucket's last gradient in that order keeps a Python hook (``_last_hook``); the others' hooks are
their bucket's ``arrivals.append``, a C call. See the block above ``_last_hook``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Iterator

import torch

from ..counters import COUNTERS
from .parameters import TWICE_ERROR
from .submission import active_job, current_job

log = logging.getLogger("gpucomm")


class GradientHooks:
    """The hook and the backward bookkeeping of ``DistributedSteps`` (merged into its namespace:
    ``self`` is the optimizer)."""

    def _hook(self, p: torch.Tensor) -> None:
        # Parameters are keyed by ``id(p)`` here and in the buckets: a tensor's ``__hash__`` is a Python call
        # (torch/_tensor.py), and a hook made eleven of them (ResNet-50: 1,771 per step).
        if self._local_only:
            return
        if not self._hooked and self._job_ref() is not active_job():  # once per step: the job is the same
            self.rebind()
        key = id(p)
        with self._lock:
            delay = self._delay.get(key)
            if delay is None:  # not in the agreed layout (it was frozen when the layout was agreed)
                return
            self._hooked = True  # zero_grad() is refused from now until synchronize (Horovod's guard)
            self._delay[key] = delay = delay - 1
            if delay:  # still accumulating locally (backward_passes_per_step), or here once too often
                if delay > 0:
                    return
                raise AssertionError(TWICE_ERROR)
            if not self._step_opened:
                self._open_step()
            tracer = self._tracer
            if tracer is not None:  # the backward pass, as seen from its gradients (timeline)
                now = tracer.now_us()
                self._backward_span = (self._backward_span[0] if self._backward_span else now, now)
            if self._watch is not None:
                self._watch[p] = time.perf_counter()
            self._synchronized = False
            buckets = self._buckets
            slot = buckets.slot_of.get(key)
            if slot is not None:
                g = p.grad
                if g is not None and g.is_sparse:
                    self._sparse.arrived(p, g)
                    # it must be handed back sparse (``SparseGradients.hand_back``): no hooks by arrival order
                    # for this optimizer (one that turns sparse later is reported by its bucket's pack)
                    self._order_allowed = False
                buckets.gradient_ready(p, g, slot)
            # an agreed sparse parameter is reduced at synchronize(), after the buckets

    def _open_step(self) -> None:
        """(holding ``_lock``; the step's first gradient hook) Open the step on the schedule, before any
        launch (a bucket missing a gradient on one rank would otherwise open it later there than
        elsewhere), and look the tracer up once for the step."""
        self._schedule.begin_step(self._flush_step)
        self._tracer = self._buckets.tracer = current_job().tracer
        self._mark_backward()
        self._step_opened = True  # (not before: a failed opening is tried again by the next hook)

    # -- hooks by arrival order ------------------------------------------------------------------
    # A hook per gradient costs about 2.5 us of Python per parameter and step (ResNet-50: 161 of them).
    # Once a step's gradients all came through their hooks, each bucket's last one in that order keeps a
    # Python hook (``_last_hook``), its first one a hook that opens the step (``_first_hook``), and the
    # others' hooks become their bucket's ``arrivals.append``, a C call: the last one launches its bucket
    # when the others have all come (a step that only C hooks reached opens when this rank next submits a
    # negotiated collective: ``_open_before_negotiated``). A step in which they had
    # not (backward's order changed, a gradient did not come) is launched at synchronize, complete, and
    # the next step records the order again; a gradient that came twice raises as Horovod's does.
    MAX_ORDER_CHANGES = 3  # after this many steps out of order, every gradient keeps its own hook

    def _last_hook(self, k: int, p: torch.Tensor) -> None:
        """(by arrival order) The hook of bucket ``k``'s last gradient: open the step at its first, and
        launch the buckets complete so far, in order."""
        if self._local_only:
            return
        if not self._hooked and self._job_ref() is not active_job():  # once per step: the job is the same
            self.rebind()
            if not self._by_order:  # the new job's layout hooks every gradient: this one as they are
                self._hook(p)
                return
        with self._lock:
            self._hooked = True
            if not self._step_opened:
                self._open_step()
            tracer = self._tracer
            if tracer is not None:
                now = tracer.now_us()
                self._backward_span = (self._backward_span[0] if self._backward_span else now, now)
            self._synchronized = False
            if not self._buckets.last_arrived(k):
                raise AssertionError(TWICE_ERROR)

    def _first_hook(self, append, p: torch.Tensor) -> None:
        """(by arrival order) The hook of a bucket's first gradient in the recorded order: noted as the
        others are, and it opens the step, as a hook per gradient did at the step's first gradient (a
        negotiated collective issued before ``step()`` is then placed after the step's buckets on every
        rank that reached one, also where backward reached no bucket's last gradient)."""
        append(p)
        if self._step_opened or self._local_only:
            return
        if not self._hooked and self._job_ref() is not active_job():
            return  # a re-formed job: the bucket's last hook rebinds (and the step opens then)
        with self._lock:
            self._hooked = True
            if not self._step_opened:
                self._open_step()

    def _open_before_negotiated(self) -> None:
        """(by arrival order; the data plane calls it before this rank submits a negotiated collective, on
        the submitting thread) Open the step when some gradient of it came through a C hook and no hook
        opened it (a backward that reached only gradients between a bucket's first and last, e.g. a
        branch some ranks skip): the collective is then placed after the step's buckets, as on a rank
        whose backward opened the step (a hook per gradient opened it at any gradient).

        Only on the thread whose ``step()`` turned hooks by arrival order on (a loop moved to another
        thread since gets the placement below until the order is recorded again): there, a backward is either over (``backward()``
        returned) or running this very call (a hook of yours), and ``_mark_backward`` tells which. From
        another thread, a backward may still be running elsewhere, which it cannot see: a flush would then
        launch the step with gradients still to come, averaging zeros for them. Such a thread's collective
        is placed as it was before (where its submission finds the step)."""
        if self._step_opened or self._step_launched or self._local_only or not self._by_order:
            return
        if threading.get_ident() != self._order_thread or self._schedule is None:  # (None: closed meanwhile)
            return
        if not self._buckets.arrivals_pending() or self._job_ref() is not active_job():
            return
        with self._lock:
            if not (self._step_opened or self._step_launched):
                self._hooked = True
                self._open_step()

    def _bucket_saw_sparse(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """(a bucket, packing) ``p``'s gradient came sparse and goes densified: it is handed back sparse
        at this step's end, as a hook per gradient sees to (``_hook``). By arrival order its C hook could
        not see it, so every gradient gets its own hook again after this step."""
        self._sparse.arrived(p, g)
        self._order_allowed = False

    def _order_eligible(self) -> bool:
        """Whether this optimizer may hook by arrival order: a plain one (not ZeRO's, PowerSGD's or a
        subclass's), one backward per step, no step being watched (the first re-cut, autotune), not
        inside ``no_sync``, no bucketed gradient seen sparse, and the order held often enough so far."""
        return (self._order_allowed and self._kind == "DistributedOptimizer" and self._powersgd is None
                and self._passes == 1 and not self._local_only and self._watch is None
                and (self._autotune is None or (self._tuner is not None and self._tuner.done))
                and not self._sparse.due and self._order_changes < self.MAX_ORDER_CHANGES)

    def _settle_hooks(self) -> None:
        """(the end of ``synchronize``, after any new layout) Hook by the order just recorded, when the
        step's gradients all came through their hooks and the layout is still the one they came to."""
        verdict, self._step_verdict = self._step_verdict, None
        if verdict is not None:  # last, after the step's bookkeeping: a raise leaves nothing half done
            self._order_held(verdict)
        recorded, self._recorded_order = self._recorded_order, None
        if self._by_order and not self._order_allowed:  # a gradient came sparse (``_bucket_saw_sparse``)
            self._hook_every_gradient()
            return
        if self._by_order or recorded is None or recorded[0] is not self._buckets or not self._order_eligible():
            return
        buckets = self._buckets
        if not all(p.requires_grad and p in self._hooks for b in buckets.buckets for p in b.params):
            return  # (a parameter frozen after the layout: the next layout records anew)
        firsts, lasts = recorded[1]
        for k, (bucket, first, last) in enumerate(zip(buckets.buckets, firsts, lasts)):
            append = buckets.arrivals[k].append
            for j, p in enumerate(bucket.params):
                self._hooks.pop(p).remove()
                hook = (functools.partial(self._last_hook, k) if j == last else
                        functools.partial(self._first_hook, append) if j == first else append)
                self._hooks[p] = p.register_post_accumulate_grad_hook(hook)
        buckets.by_order = self._by_order = True
        self._order_thread = threading.get_ident()  # the training loop's (step() runs this)
        self._schedule.open_before_negotiated(self._open_before_negotiated)

    def _order_held(self, verdict: str) -> None:
        """(after a step by arrival order; ``verdict``: ``GradientBuckets.arrival_verdict``) Count it; out
        of order, hook every gradient again (the next step records the order anew); twice, raise (unless a
        last hook raised it already)."""
        if verdict == "kept":
            COUNTERS.grad_steps_by_order += 1
            return
        self._hook_every_gradient()
        if verdict == "twice":
            raise AssertionError(TWICE_ERROR)
        if verdict == "raised":  # by the last hook that fired twice, in backward
            return
        COUNTERS.grad_order_changes += 1
        self._order_changes += 1
        if self._order_changes == self.MAX_ORDER_CHANGES:
            log.info("gpucomm: %s's gradients came in a different order in %d steps; every gradient keeps a hook "
                     "of its own from now on (a Python call each per step).", self._kind, self._order_changes)

    def _gradients_came(self) -> bool:
        """Some gradient of this step was handed over: a per-gradient or Python hook fired, or (by arrival
        order) a C hook noted one outside ``no_sync``."""
        return self._hooked or (self._by_order and not self._local_only and self._buckets.arrivals_pending())

    def _hook_every_gradient(self) -> None:
        """(between steps) Leave hooks by arrival order: every gradient's own hook again."""
        for bucket in self._buckets.buckets:
            for p in bucket.params:
                old = self._hooks.pop(p, None)
                if old is not None:
                    old.remove()
                if p.requires_grad:  # (one frozen since is left to the new layout agreed at this step's end)
                    self._hooks[p] = p.register_post_accumulate_grad_hook(self._hook)
        self._buckets.by_order = self._by_order = False
        if self._schedule is not None:
            self._schedule.open_before_negotiated(None)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients locally (like DDP's
        ``no_sync``); the first backward after it averages the accumulated sum."""
        self._local_only = True
        buckets = self._buckets if self._by_order else None
        marks = buckets.mark_arrivals() if buckets is not None else None
        try:
            yield
        finally:
            self._local_only = False
            if buckets is not None and buckets is self._buckets and self._by_order:
                buckets.drop_arrivals_since(marks)  # their hooks are C calls: they counted inside too

    def _launch_step(self) -> None:
        """(holding ``_lock``) Launch what is left of this step on the schedule: the buckets still
        waiting for gradients (missing ones count as zeros), then the sparse reductions; the step
        then ends (negotiated CUDA work that waited for it is issued). A rank whose hooks did not
        fire opens the step here, so its collectives are placed as every other rank's are."""
        self._schedule.begin_step(self._flush_step)
        if self._by_order:
            self._order_verdict = self._buckets.arrival_verdict()
        self._buckets.launch_rest()
        self._sparse.launch_all()
        self._schedule.end_step()
        self._step_launched = True

    def _flush_step(self) -> None:
        """A caller outside backward needs the GPU's issue order while this step is open (e.g. an
        ``hvd.allreduce`` between ``backward()`` and ``step()``): finish the step's launches now, as
        ``synchronize()`` would; ``synchronize()`` then only waits. A caller on another thread while
        this step's backward still runs waits for it to end first (its gradients are not all there)."""
        with self._backward_cv:
            self._backward_cv.wait_for(lambda: not self._in_backward, timeout=self._schedule.timeout)
        with self._lock:
            # only this step's own launches: a flush that comes late (its caller took the list of open steps
            # before this one ended) must not end the step synchronize() opened after it (PowerSGD's second
            # phase), nor open an empty one
            if self._schedule is not None and self._schedule.in_step and not self._step_launched:
                self._launch_step()

    def _mark_backward(self) -> None:
        """(the step's first gradient hook) This step's backward runs until autograd's final callback."""
        self._in_backward = True
        self._buckets.begin_backward()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except RuntimeError:  # a hook run outside a backward pass (by hand): nothing runs on
            self._in_backward = False
            self._buckets.end_backward()

    def _backward_ended(self) -> None:
        self._buckets.end_backward()
        schedule = self._schedule
        if schedule is not None:
            schedule.seal()  # the buckets launched in backward are watched from now, before any wait
        with self._backward_cv:
            self._in_backward = False
            self._backward_cv.notify_all()
