"""``DistributedOptimizer`` attached to a job: bound when built (the job's size sets the scaling,
a schedule of its own carries the buckets, the layout is agreed), bound again when elastic
training re-formed the job, standing in after ``hvd.join`` until every rank has joined, and
closed (its communicator released at a collective point).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ..settings import AUTOTUNE, FUSION_BY_READINESS, HOOKS_BY_ARRIVAL_ORDER, ONE_RANK_REDUCER
from . import finite_check
from .autotune import Autotuner, AutotuneSettings
from .collectives import barrier
from .sparse_grads import SparseGradients
from .submission import AUTO_BUDGET, Average, FiniteSlots, active_job, current_job, set_id

log = logging.getLogger("gpucomm")


def one_rank_reducer(environ: Any = None) -> bool:
    """Whether a one-rank job runs the reducer's full schedule (``GPUCOMM_ONE_RANK_REDUCER=1``): hooks,
    buckets and a one-rank communicator, as DDP runs its reducer at size 1, so that the reducer's
    own cost can be measured on one GPU. Off by default: a one-rank job has nothing to average."""
    return ONE_RANK_REDUCER.read(environ, False)


class JobBinding:
    """Binding to a job, re-binding, joining and closing, for ``DistributedSteps`` (merged into
    its namespace: ``self`` is the optimizer)."""

    def _bind(self, job) -> None:
        """Attach to ``job``: its size sets the scaling, its schedule carries the buckets, and the
        layout is agreed among its ranks (a collective)."""
        self._job_ref = weakref.ref(job)
        self._hooked = False
        self._step_launched = False
        self._set_id = set_id(self._process_set)
        group = job.group(self._set_id)
        self._size, self._ranks = group.size, group.ranks
        # a one-rank job runs no reducer, unless GPUCOMM_ONE_RANK_REDUCER asks for its full schedule (as
        # DDP runs its reducer at size 1): what the reducer itself costs is then measured on one GPU
        self._reducing = self._size > 1 or (self._reduces_at_one_rank and one_rank_reducer())
        self._finite = (FiniteSlots(self._check_mode, group.rank, self._size,
                                    budget=AUTO_BUDGET if self._check_mode == finite_check.DEFAULT_MODE else None)
                        if self._check_mode is not None and self._reducing else None)
        # Average: 1/f before the sum (packed in), f/size after (unpacked out), Horovod's predivide rule
        self._prescale = 1.0 / self._predivide if self._op == Average else 1.0
        self._postscale = self._predivide / self._size if self._op == Average else 1.0
        self._step_opened = False  # a gradient of this step was handed over (the step is open on the schedule)
        self._backward_span: tuple[float, float] | None = None  # first and last gradient of this step (timeline)
        self._tracer: Any = None  # the timeline's tracer, looked up once per step (at its first gradient)
        self._schedule = job.new_schedule(self._set_id) if self._reducing else None
        self._layouts = 0
        self._ready_us: list[float | None] | None = None  # when each gradient arrived in the watched step
        self._planned: list[list[int]] | None = None  # autotune's buckets (indices into the dense gradients)
        if not self._reducing:
            for hook in self._hooks.values():
                hook.remove()
            self._hooks.clear()
            self._by_order = False
        # hooks by arrival order (``gradient_hooks``): allowed, and how often the order failed to hold
        self._order_allowed = HOOKS_BY_ARRIVAL_ORDER.read(None, True)
        self._order_changes = 0
        self._recorded_order: tuple[Any, tuple[list[int], list[int]]] | None = None
        self._order_verdict: str | None = None
        self._sparse = SparseGradients(self._params, self._parameter_names, self._op, self._process_set,
                                       self._sparse_as_dense,
                                       f"DistributedOptimizer.sparse.{getattr(self._schedule, 'number', 0)}",
                                       self._schedule, self._size)
        self._buckets = self._agree_on_layout(job)
        # On CPU the first step is watched, and the buckets are cut again where backward pauses
        # (``fusion.plan_by_readiness``), once, from rank 0's timings (DDP rebuilds after step 1 too).
        self._watch: dict[torch.Tensor, float] | None = None
        self._tuner_watches = False  # the watched step is the autotuner's
        if (self._size > 1 and self._groups is None and FUSION_BY_READINESS.read(None, True)
                and all(b.plan.device.type == "cpu" for b in self._buckets.buckets)):
            self._watch = {}
        # autotune (``autotune.py``) starts once that first re-cut is done
        self._autotune = (AutotuneSettings.from_env() if self._size > 1 and self._groups is None and self._tunable
                          else None)
        if self._autotune is None and self._size > 1 and AUTOTUNE.read(None, False):
            why = ("its buckets are the groups= given" if self._groups is not None
                   else f"a {self._kind} reduce-scatters its buckets; autotune times allreduces")
            log.warning("gpucomm autotune: GPUCOMM_AUTOTUNE/HOROVOD_AUTOTUNE asks for it, but it is off for this %s: %s.",
                        self._kind, why)
        self._tuner: Autotuner | None = None
        if self._schedule is not None:
            # every device it may launch on, in parameter order (building a backend is a collective)
            for device in dict.fromkeys(p.device for p in self._params):
                self._schedule.open(device)
            self._buckets.warm_up()  # a collective point: NCCL connects here, never inside a backward hook
            job.add_join_party(self)
        # no finalizer releases the schedule: garbage collection runs at a different moment on every
        # rank, and a communicator is released only at a collective point (``close()``, or shutdown)

    def rebind(self) -> None:
        """Elastic training re-formed the job (``hvd.elastic.run``): attach to the new one. Every
        rank of the new job calls this at the same point (``TorchState.sync()`` does, or the first
        gradient hook or ``synchronize()`` after the re-form)."""
        job = current_job()
        old = self._job_ref() if self._job_ref is not None else None
        if old is job and old is not None:
            return
        failure = old.failure() if old is not None else None
        if failure is None:
            self._drain_checks()  # a GPU's last reports, decoded against the buckets that produced them
        elif self._finite is not None and self._buckets.check_reports_pending():
            # their reductions may have been aborted with the job: what the slots hold is not a finding
            log.info("gpucomm finite check: the reports of the last steps before the job failed (%s) were "
                     "not read: their reductions may have been cut short.", failure)
        self._bind(job)

    def close(self) -> None:
        """Release this optimizer's communicator now (a collective: call it on every rank at the same
        point). Without it, the communicator lives until ``hvd.shutdown()``; it is never released
        when the optimizer is garbage-collected, which happens at a different moment on every rank."""
        self._settle_parameters()
        self._drain_checks()
        job = self._job_ref() if self._job_ref is not None else None
        if self._schedule is not None and job is not None and job is active_job():
            # a collective point: no member may still be building the communicator this releases
            barrier(self._process_set)
        schedule, self._schedule = self._schedule, None
        self._closed = True
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        if schedule is not None and job is not None:
            job.close_schedule(schedule)

    def stand_in_until_all_joined(self) -> None:
        """This rank joined (``hvd.join``): take part in the other ranks' steps with zeros until
        every rank has joined."""
        while True:
            trained = self._buckets.stand_in_step()
            if self._powersgd is not None:  # the step count stays alike on every rank (it decides the form)
                self._powersgd.step_done()
            if not trained:
                return
