"""``DistributedOptimizer``'s gradient hooks: each trainable parameter's post-accumulate-grad hook
hands its gradient to its bucket (which launches once complete), and the step's backward is
followed from its first hook to autograd's final callback.

What the hooks do between backward and ``synchronize()``: open the step on the schedule at the
step's first gradient, count ``backward_passes_per_step``, time the gradients for the first re-cut
and for autotune, and launch what is left of the step when a caller outside backward needs the
GPU's issue order (``_flush_step``); ``no_sync()`` leaves the gradients to accumulate locally.
Kept apart from the step's reduction (``distributed_steps.py``): they run on autograd's threads,
under the optimizer's lock.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from .parameters import TWICE_ERROR
from .submission import active_job, current_job


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
            if not self._step_opened:  # the step's first gradient: it opens the step on the schedule (before
                # any launch: a bucket missing a gradient on one rank would otherwise open it later there than
                # elsewhere), and the tracer is looked up once for the step
                self._schedule.begin_step(self._flush_step)
                self._tracer = self._buckets.tracer = current_job().tracer
                self._mark_backward()
                self._step_opened = True  # (not before: a failed opening is tried again by the next hook)
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
                buckets.gradient_ready(p, g, slot)
            # an agreed sparse parameter is reduced at synchronize(), after the buckets

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients locally (like DDP's
        ``no_sync``); the first backward after it averages the accumulated sum."""
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = False

    def _launch_step(self) -> None:
        """(holding ``_lock``) Launch what is left of this step on the schedule: the buckets still
        waiting for gradients (missing ones count as zeros), then the sparse reductions; the step
        then ends (negotiated CUDA work that waited for it is issued). A rank whose hooks did not
        fire opens the step here, so its collectives are placed as every other rank's are."""
        self._schedule.begin_step(self._flush_step)
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
