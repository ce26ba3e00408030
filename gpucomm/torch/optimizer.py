"""``DistributedOptimizer``: gradients averaged across ranks while backward is still running.

Each trainable parameter gets a post-accumulate-grad hook. Parameters are grouped into buckets
(``gpucomm.dataplane.fusion``: reverse order, one dtype and device each, 1 MiB first, then 25 MiB);
when the last gradient of a bucket arrives, and every earlier bucket has been launched, the bucket's
allreduce is launched on the optimizer's fixed schedule by the data plane's reducer
(``gpucomm.dataplane.reducer``; the bucket kinds in ``bucket_kinds``: gradients end up living in the
buckets, see there), so communication overlaps the rest of backward. ``synchronize()`` (called by
``step()``) launches what is left and waits for the buckets in order.

Agree once, then run a fixed schedule: the parameters (names, shapes, dtypes) and the bucket
layout are verified across ranks when the optimizer is built, and again only when the set of
parameters that need gradients changes; every step in between sends no control-plane message.
A parameter whose hook did not fire by ``synchronize()`` is reduced as zeros (Horovod's rule), so
the ranks' collectives always match.

Semantics follow Horovod: a subclass of the wrapped optimizer's class, ``synchronize``,
``skip_synchronize``, ``set_backward_passes_per_step``, the ``zero_grad`` guard and the warning when
``step()`` follows ``synchronize()``. A parameter that produced no gradient on this rank
contributes zeros (and, if it still requires grad, receives the averaged gradient); a parameter
frozen with ``requires_grad_(False)`` contributes zeros and keeps its gradient untouched until the
next layout leaves it out. Sparse gradients (``nn.Embedding(sparse=True)``): ``sparse_as_dense=True``
averages them densely in their buckets; otherwise they are reduced sparse, outside the buckets,
once the ranks agreed which parameters have them (``sparse_grads.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Iterator

import torch

from ..counters import COUNTERS
from ..process_sets import ProcessSet, global_process_set
from ..tuning.plans import to_fusion_buckets
from .autotune import Autotuner, AutotuneSettings
from . import finite_check
from .adasum import adasum_optimizer
from .compression import Compression, PowerSGD, resolve as resolve_compression, wire_of
from .powersgd import PowerSGDState, powersgd_buckets
from .zero import ZeroSettings, check_closure_free, check_elementwise, sharded_steps
from ..errors import CollectiveError as HorovodInternalError, NonFiniteGradientError
from ..settings import AUTOTUNE, FUSION_BY_READINESS, ONE_RANK_REDUCER
from .functions import allgather_object, broadcast_object
from .collectives import barrier
from .submission import (AUTO_BUDGET, Adasum, Average, BucketSettings, FiniteSlots, GradientBuckets, MakeBuckets, Sum,
                         active_job, current_job, fused_wire, plan_buckets, plan_by_readiness, plan_groups, set_id,
                         views_wanted)
from .parameters import (STEP_AFTER_SYNC_WARNING, TWICE_ERROR, ZERO_GRAD_ERROR, check_passes,  # noqa: F401
                         check_same_parameters, parameter_names, shared_steps)
from .sparse_grads import SparseGradients

log = logging.getLogger("gpucomm")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class; see ``DistributedOptimizer``.
    ``ZeroRedundancyOptimizer`` merges ``zero.ShardedSteps`` over it (``_prepare``,
    ``_bucket_maker``, ``_settle_parameters`` and ``_tunable`` are the points it changes)."""

    _tunable = True  # autotune may re-cut the buckets
    _kind = "DistributedOptimizer"  # what errors call this optimizer
    _reduces_at_one_rank = True  # GPUCOMM_ONE_RANK_REDUCER may run the schedule at size 1

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, check_finite=None):
        super(self.__class__, self).__init__(params)  # the wrapped class's __init__ with its defaults
        self._check_mode = finite_check.resolve_mode(check_finite)
        self.last_nonfinite: list[finite_check.Finding] = []  # the finite check's latest findings (see _report_checks)
        self._pending_reports: list = []  # the finite check's reports of the step just synchronized, until settled
        self._warned_nonfinite = False  # the default mode warns once
        self._steps = 0  # steps synchronized (the finite check's report names the step)
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._passes = backward_passes_per_step
        self._groups = groups
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = parameter_names(named_parameters, self._params)
        # PowerSGD's per-parameter state (warm-start Q, this rank's error, the step count), kept across layouts
        self._powersgd = PowerSGDState(compression, self._params) if isinstance(compression, PowerSGD) else None
        self._process_set = process_set
        self._op, self._predivide = op, float(gradient_predivide_factor)
        self._synchronized = False
        self._should_synchronize = True
        self._local_only = False
        self._hooks: dict[torch.Tensor, Any] = {}
        self._lock = threading.Lock()  # hooks of CPU and CUDA parameters run on different autograd threads
        self._job_ref: Any = None
        self._schedule: Any = None
        self._closed = False
        self._in_backward = False  # this step's backward is running (a flush from another thread waits)
        self._backward_cv = threading.Condition()
        self._hooked = False  # a gradient hook fired since the last synchronize
        self._prepare()
        self._bind(current_job())

    def _prepare(self) -> None:
        """What a merged class sets up before the layout is first agreed (DistributedOptimizer: nothing)."""

    def _settle_parameters(self) -> None:
        """Before ``zero_grad`` and ``close``: parameters still being written are written (DistributedOptimizer:
        none are)."""

    def _bind(self, job) -> None:
        """Attach to ``job``: its size sets the scaling, its schedule carries the buckets, and the
        layout is agreed among its ranks (a collective)."""
        self._job_ref = weakref.ref(job)
        self._hooked = False
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
        self._fired: set[torch.Tensor] = set()
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
        if self._job_ref is not None and self._job_ref() is job:
            return
        self._bind(job)

    # ------------------------------------------------------------------ the layout, agreed once

    def _agree_on_layout(self, job) -> GradientBuckets:
        """Plan buckets for the parameters that need gradients now, verify parameters and buckets
        across ranks (a collective: every rank calls this at the same point), and hook them. Nothing
        of the optimizer changes unless the ranks agreed."""
        requires = [p.requires_grad for p in self._params]
        trainable = [p for p in self._params if p.requires_grad]
        dense = self._sparse.split(trainable)  # the agreed sparse ones are reduced on their own
        if self._groups is not None:
            plans = plan_groups(dense, _trainable_groups(self._groups, dense))
        elif self._planned is not None and sorted(i for b in self._planned for i in b) == list(range(len(dense))):
            plans = to_fusion_buckets(dense, self._planned)
        elif self._ready_us is not None:
            index = {p: i for i, p in enumerate(self._params)}
            plans = plan_by_readiness(dense, [self._ready_us[index[p]] for p in dense])
        else:
            plans = plan_buckets(dense)
        settings = BucketSettings(self._compression, self._prescale, self._postscale, self._set_id, self._finite,
                                  average=self._op == Average, predivide=self._predivide,
                                  wire_of=wire_of(self._compression), views=views_wanted())
        buckets = GradientBuckets(self._schedule, dense, plans, settings, self._flush_step, make=self._bucket_maker())
        self._layouts += 1
        if self._reducing:
            self._verify_everywhere(buckets)
            if self._layouts > 1:  # a new layout, agreed at a collective point: NCCL connects for it here
                buckets.warm_up()
            hooked = set(trainable)
            for p in list(self._hooks):
                if p not in hooked:
                    self._hooks.pop(p).remove()
            for p in trainable:
                if p not in self._hooks:
                    self._hooks[p] = p.register_post_accumulate_grad_hook(self._hook)
        self._requires, self._trainable, self._dense = requires, trainable, dense
        self._delay = {p: self._passes for p in trainable}
        return buckets

    def _bucket_maker(self) -> MakeBuckets | None:
        """How this optimizer's buckets are built from the plans (None: ``buckets.standard_buckets``)."""
        if self._powersgd is not None:
            return powersgd_buckets(self._powersgd, self._size)
        return None

    def _verify_everywhere(self, buckets: GradientBuckets) -> None:
        index = {p: i for i, p in enumerate(self._params)}
        params = [(self._parameter_names[p], list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                  for p in self._params]
        layout = [([index[p] for p in b.params], str(b.wire_dtype), type(b).__name__) for b in buckets.buckets]
        sparse = [index[p] for p in self._sparse.active]
        describe = getattr(self._compression, "describe", None)
        mine = {"params": params, "buckets": layout, "schedule": self._schedule.number, "sparse": sparse,
                "compression": describe() if callable(describe) else getattr(self._compression, "__name__", "user"),
                "sparse_as_dense": self._sparse_as_dense,
                "check_finite": self._finite.mode if self._finite is not None else None,
                "strides": [list(buckets.stride_of(p)) for p in self._params if p in buckets.bucket_of],
                "optimizer": self._agreed_optimizer()}
        COUNTERS.layout_checks += 1
        every = allgather_object(mine, name=f"DistributedOptimizer.layout.{self._schedule.number}.{self._layouts}",
                                 process_set=self._process_set)
        for rank, theirs in enumerate(every):
            check_same_parameters(every[0]["params"], theirs["params"], rank, self._kind)
        for rank, theirs in enumerate(every):
            if theirs["optimizer"] != every[0]["optimizer"]:
                raise ValueError(
                    f"{self._kind}: ranks disagree on the optimizer class that steps the parameters: rank 0 has "
                    f"{every[0]['optimizer'].get('class')}, rank {rank} has {theirs['optimizer'].get('class')}. Each "
                    f"rank steps its own shard of the parameters with its own optimizer, so different classes would "
                    f"silently train each shard differently. Build it with the same optimizer class on every rank.")
        for rank, theirs in enumerate(every):
            if theirs != every[0]:
                raise ValueError(
                    f"{self._kind}: ranks disagree on the gradient buckets (rank 0: {_layout_text(every[0])}; "
                    f"rank {rank}: {_layout_text(theirs)}), although their parameters match. Every rank must plan the "
                    f"same buckets, or their allreduces would pair unrelated data. Likely causes: "
                    f"GPUCOMM_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD / GPUCOMM_FUSION_FIRST_BUCKET, groups=, "
                    f"sparse_as_dense=, compression= (PowerSGD's settings) or check_finite= (GPUCOMM_CHECK_FINITE) set "
                    f"differently on some ranks, a "
                    f"model in channels_last memory format on some ranks only (gradients travel in the parameters' "
                    f"memory order), or DistributedOptimizers built in a different order. Set them alike on every "
                    f"rank.")

    def _agreed_optimizer(self) -> dict:
        """What of the wrapped optimizer the ranks must share (DistributedOptimizer: nothing; every
        rank steps every parameter, as Horovod's does)."""
        return {}

    def _layout_changed(self) -> bool:
        return [p.requires_grad for p in self._params] != self._requires

    def _adopt_new_layout(self, sparse_agreed: bool = False) -> None:
        """The parameters that need gradients changed (a layer was frozen or unfrozen), or some
        turned out sparse: agree on the new layout (and, unless just done, on which parameters are
        sparse), and average now the gradients of parameters that just joined it."""
        if not sparse_agreed:
            self._sparse.agree()
        if self._tuner is not None and not self._tuner.done:  # its plans index the old layout: start over
            log.info("gpucomm autotune: the trainable parameters changed during the trial; it starts again")
            self._tuner = None
        self._planned = None
        before = set(self._trainable)
        self._drain_checks()  # the old layout's reports still on their way, decoded against it
        self._buckets = self._agree_on_layout(current_job())
        added = [p for p in self._trainable if p not in before]
        if added and self._reducing:
            self._buckets.reduce_once(added, f"DistributedOptimizer.added.{self._layouts}")

    # ------------------------------------------------------------------ hooks and launching

    def _hook(self, p: torch.Tensor) -> None:
        if self._local_only:
            return
        if not self._hooked and self._job_ref() is not active_job():  # once per step: the job is the same
            self.rebind()
        with self._lock:
            delay = self._delay.get(p)
            if delay is None:  # not in the agreed layout (it was frozen when the layout was agreed)
                return
            self._hooked = True  # zero_grad() is refused from now until synchronize (Horovod's guard)
            self._delay[p] = delay = delay - 1
            if delay > 0:
                return
            if not self._fired:  # the step's first gradient: it opens the step on the schedule (before any
                # launch: a bucket missing a gradient on one rank would otherwise open it later there than
                # elsewhere), and the tracer is looked up once for the step
                self._schedule.begin_step(self._flush_step)
                self._tracer = self._buckets.tracer = current_job().tracer
                self._mark_backward()
            tracer = self._tracer
            if tracer is not None:  # the backward pass, as seen from its gradients (timeline)
                now = tracer.now_us()
                self._backward_span = (self._backward_span[0] if self._backward_span else now, now)
            if delay < 0 or p in self._fired:
                raise AssertionError(TWICE_ERROR)
            if self._watch is not None:
                self._watch[p] = time.perf_counter()
            self._fired.add(p)
            self._synchronized = False
            if p in self._buckets.bucket_of:
                g = p.grad
                if g is not None and g.is_sparse:
                    self._sparse.arrived(p, g)
                self._buckets.gradient_ready(p)
            # an agreed sparse parameter is reduced at synchronize(), after the buckets

    # ------------------------------------------------------------------ Horovod API

    def synchronize(self) -> None:
        """Finish averaging every gradient: launch the buckets not yet launched, wait for all in
        order, and write the averaged gradients into ``p.grad``."""
        if self._reduce_step():
            self._settle_step()

    def _reduce_step(self) -> bool:
        """The reduction part of ``synchronize``: False for a one-rank job (nothing to reduce)."""
        if self._closed:
            raise ValueError("this DistributedOptimizer was closed (optimizer.close()): it averages no more gradients "
                             "and has released its communicator. Build a new DistributedOptimizer to keep training.")
        if self._job_ref() is not active_job():
            self.rebind()
        if not self._reducing:
            self._synchronized = True
            if self._powersgd is not None:
                self._powersgd.step_done()
            return False
        with self._lock:
            self._launch_step()
        try:
            reports = self._buckets.finish(self._steps + 1)
            self._sparse.finish()
        finally:
            self._reset_step()
        COUNTERS.schedule_steps += 1
        self._steps += 1
        if self._powersgd is not None:
            self._powersgd.step_done()
        self._pending_reports = reports
        self._synchronized = True
        span, self._backward_span = self._backward_span, None
        tracer = current_job().tracer
        if tracer is not None and span is not None:
            tracer.span("DistributedOptimizer.backward", "BACKWARD", span[0], span[1])
        return True

    def _settle_step(self) -> None:
        """After a step's reduction: the first re-cut, autotune, a changed layout, the finite check's report."""
        recut = False
        if self._watch is not None and not self._tuner_watches:
            recut = self._cut_where_backward_pauses()
        elif self._autotune is not None:
            self._autotune_step()
        if recut:
            pass
        elif self._sparse.due and self._sparse.agree():
            self._adopt_new_layout(sparse_agreed=True)
        elif self._layout_changed():
            self._adopt_new_layout()
        self._sparse.hand_back()
        reports, self._pending_reports = self._pending_reports, []
        self._report_checks(reports)

    def _report_checks(self, reports: list, buckets: Any = None) -> None:
        """The finite check's reports, per step (``GradientBuckets.finish``; on a GPU outside "raise"
        mode, an earlier step's arriving now): decoded against ``buckets`` (default: the current
        layout), kept in ``last_nonfinite`` and reported."""
        for step, slots in reports:
            findings = self._findings(slots, buckets or self._buckets)
            if findings:
                self.last_nonfinite = findings
                self._report_nonfinite(findings, step)

    def _drain_checks(self) -> None:
        """Report what the finite check still has on its way to the host (a GPU's last step), before
        the buckets it refers to are replaced or released."""
        buckets = getattr(self, "_buckets", None)
        if buckets is not None and self._finite is not None:
            self._report_checks(buckets.check_reports(wait=True), buckets)

    def _findings(self, reports: list[tuple[int, int, int]], buckets: Any) -> list[finite_check.Finding]:
        """The finite check's slots, decoded: each reporting rank's first non-finite parameter, the
        earliest in backward order first (the same list on every rank)."""
        findings = []
        for index, bucket_index, value in reports:
            bucket = buckets.buckets[bucket_index]
            param = value - 1 if value - 1 < len(bucket.params) else -1
            limit = finite_check.exact_limit(bucket.wire_dtype or torch.float32)
            if value >= limit and len(bucket.params) > limit:
                param = -1  # the slot's dtype cannot say which of the later parameters
            name = self._parameter_names[bucket.params[param]] if param >= 0 else \
                f"#{limit - 1} or later of bucket {bucket_index}"
            findings.append(finite_check.Finding(self._ranks[index], bucket_index, param, name))
        return sorted(findings, key=lambda f: (f.bucket, f.param if f.param >= 0 else 1 << 62, f.rank))

    def _report_nonfinite(self, findings: list[finite_check.Finding], step: int) -> None:
        """Raise or warn on every rank (the same step, the same findings); AMP's GradScaler in use:
        its overflow steps are expected (it skips them), so only report them. The default mode
        warns at the first non-finite step and logs the later ones at INFO."""
        COUNTERS.nonfinite_steps += 1
        text = finite_check.describe(step, findings, self._check_mode)
        if finite_check.active_grad_scaler() is not None:
            COUNTERS.nonfinite_skipped += 1
            log.info("%s (torch.amp.GradScaler is in use: it skips this step and lowers its scale; not raised)", text)
            return
        if self._check_mode == "raise":
            raise NonFiniteGradientError(text, step, findings)
        first = not self._warned_nonfinite
        self._warned_nonfinite = True
        if self._ranks[0] == current_job().world.rank and (self._check_mode == "warn" or first):
            warnings.warn(text, RuntimeWarning, stacklevel=4)
        elif self._check_mode == "auto" and self._ranks[0] == current_job().world.rank:
            log.info("%s", text)
        else:
            log.debug("%s", text)

    def _cut_where_backward_pauses(self) -> bool:
        """After the watched step: take rank 0's gradient arrival times and agree on buckets cut at
        its pauses (and on any change of the trainable set). False if a rank has joined meanwhile:
        every training rank then gets the same refusal from the coordinator and keeps the buckets
        it has (the joined rank stands in with those)."""
        watched, self._watch = self._watch, None
        start = min(watched.values(), default=0.0)
        mine = [None if p not in watched else (watched[p] - start) * 1e6 for p in self._params]
        root = current_job().group(self._set_id).ranks[0]
        try:
            self._ready_us = broadcast_object(mine, root_rank=root, name=f"DistributedOptimizer.ready.{self._schedule.number}",
                                              process_set=self._process_set)
        except HorovodInternalError as e:
            if "already called join()" not in str(e):
                raise
            return False
        self._adopt_new_layout()
        return True

    # ------------------------------------------------------------------ autotune

    def _autotune_step(self) -> None:
        """A step ended: start the autotuner after the first re-cut, or tell it the step's end."""
        if self._tuner is None:
            self._tuner = self._new_tuner()
            if self._tuner is None:
                self._autotune = None
            return
        if not self._tuner.done:
            self._tuner.step_done(time.perf_counter())

    def _new_tuner(self) -> Autotuner | None:
        dense = self._dense
        kinds = {(p.dtype, p.device) for p in dense}
        if len(kinds) != 1:
            log.warning("gpucomm autotune: skipped: this optimizer's gradients have %d dtypes/devices (%s); the "
                        "planner cuts one kind of fusion buffer. Cast the model to one dtype, or leave autotune off.",
                        len(kinds), ", ".join(f"{d} on {v}" for d, v in sorted(kinds, key=str)) or "none")
            return None
        dtype, device = next(iter(kinds))
        wire = fused_wire(dtype, wire_of(self._compression)(dtype)) or dtype
        sizes = [p.numel() * wire.itemsize for p in dense]
        job = current_job()
        probes = iter(range(1 << 30))

        def time_allreduce(nbytes: int) -> float:
            buffer = torch.zeros(max(1, nbytes // wire.itemsize), dtype=wire, device=device)
            start = time.perf_counter()
            self._buckets.allreduce_now([buffer], f"DistributedOptimizer.autotune.{self._schedule.number}.probe."
                                                  f"{next(probes)}")
            return time.perf_counter() - start

        def gather(obj: Any, tag: str) -> list:
            return allgather_object(obj, name=f"DistributedOptimizer.autotune.{self._schedule.number}.{tag}."
                                              f"{self._layouts}", process_set=self._process_set)

        return Autotuner(self._autotune, sizes, cpu=device.type == "cpu", writes_log=self._ranks[0] == job.world.rank,
                         watch=self._watch_for_tuner, ready_times=self._tuner_ready_times,
                         time_allreduce=time_allreduce, gather=gather, adopt=self._recut, current_plan=self._plan_now)

    def _watch_for_tuner(self) -> None:
        self._watch, self._tuner_watches = {}, True

    def _tuner_ready_times(self) -> list[float | None]:
        """When each dense gradient arrived in the watched step (seconds from the first), then stop watching."""
        watched, self._watch, self._tuner_watches = self._watch or {}, None, False
        start = min(watched.values(), default=0.0)
        return [watched[p] - start if p in watched else None for p in self._dense]

    def _plan_now(self) -> list[list[int]]:
        index = {p: i for i, p in enumerate(self._dense)}
        return [[index[p] for p in b.params] for b in self._buckets.buckets]

    def _recut(self, plan: list[list[int]]) -> None:
        """Adopt the autotuner's ``plan`` (agreed across ranks like every layout)."""
        self._planned = plan
        self._drain_checks()  # the old layout's reports still on their way, decoded against it
        self._buckets = self._agree_on_layout(current_job())
        COUNTERS.autotune_recuts += 1

    def _launch_step(self) -> None:
        """(holding ``_lock``) Launch what is left of this step on the schedule: the buckets still
        waiting for gradients (missing ones count as zeros), then the sparse reductions; the step
        then ends (negotiated CUDA work that waited for it is issued). A rank whose hooks did not
        fire opens the step here, so its collectives are placed as every other rank's are."""
        self._schedule.begin_step(self._flush_step)
        self._buckets.launch_rest()
        self._sparse.launch_all()
        self._schedule.end_step()

    def _flush_step(self) -> None:
        """A caller outside backward needs the GPU's issue order while this step is open (e.g. an
        ``hvd.allreduce`` between ``backward()`` and ``step()``): finish the step's launches now, as
        ``synchronize()`` would; ``synchronize()`` then only waits. A caller on another thread while
        this step's backward still runs waits for it to end first (its gradients are not all there)."""
        with self._backward_cv:
            self._backward_cv.wait_for(lambda: not self._in_backward, timeout=self._schedule.timeout)
        with self._lock:
            if self._schedule is not None and self._schedule.in_step:
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

    def _reset_step(self) -> None:
        self._hooked = False
        self._tracer = None
        self._backward_ended()  # also when backward raised before its final callback
        self._buckets.reset()
        self._sparse.reset()
        for p in self._delay:
            self._delay[p] = self._passes
        self._fired.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients locally (like DDP's
        ``no_sync``); the first backward after it averages the accumulated sum."""
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Horovod's guard, then the gradients cleared as torch does: ``set_to_none=True`` (the
        default) frees them (the next step's buckets pack the new ones in, once each); with
        ``set_to_none=False`` gradients that live in their buckets (bound views of the fusion
        buffers) are zeroed where they live, one op per bucket, and backward accumulates into the
        buffer again with no copy at all (DDP's ``gradient_as_bucket_view``)."""
        if self._hooked or self._buckets.in_flight or self._sparse.in_flight:
            raise AssertionError(ZERO_GRAD_ERROR)
        self._settle_parameters()
        kept = self._buckets.zero_views(set_to_none)
        if not kept:
            result = super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        else:
            result = _zero_others(self.param_groups, kept, set_to_none)
        self._buckets.release()
        return result

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, with PowerSGD's state under ``"powersgd"`` when it is in
        use (warm-start Q, this rank's errors, the step count; see ``powersgd.PowerSGDState``)."""
        state = super(self.__class__, self).state_dict()
        if self._powersgd is not None:
            state["powersgd"] = self._powersgd.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if self._buckets.in_flight or self._sparse.in_flight:
            try:
                self.synchronize()  # finish what is in flight; the gradients are discarded by the caller's next step
            except HorovodInternalError:
                pass  # the job broke (an elastic restore follows): nothing in flight is worth keeping
        self._reset_step()
        state_dict = dict(state_dict)
        powersgd = state_dict.pop("powersgd", None)
        if powersgd is not None and self._powersgd is not None:
            self._powersgd.load_state_dict(powersgd)
        return super(self.__class__, self).load_state_dict(state_dict)


# ---------------------------------------------------------------------------------------------
# construction


def one_rank_reducer(environ: Any = None) -> bool:
    """Whether a one-rank job runs the reducer's full schedule (``GPUCOMM_ONE_RANK_REDUCER=1``): hooks,
    buckets and a one-rank communicator, as DDP runs its reducer at size 1, so that the reducer's
    own cost can be measured on one GPU. Off by default: a one-rank job has nothing to average."""
    return ONE_RANK_REDUCER.read(environ, False)


def _zero_others(param_groups: list[dict], kept: set, set_to_none: bool) -> None:
    """``Optimizer.zero_grad`` for the parameters outside ``kept`` (torch's rule for each)."""
    with torch.no_grad():
        for group in param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or p in kept:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()


def _trainable_groups(groups: Any, trainable: list[torch.Tensor]) -> Any:
    """``groups`` restricted to the parameters that need gradients now (lists of parameters)."""
    if isinstance(groups, int):
        return groups
    keep = set(trainable)
    return [[p for p in g if p in keep] for g in groups]


def _layout_text(mine: dict) -> str:
    buckets = mine["buckets"]
    sizes = ", ".join(f"{len(ids)} params ({dtype.replace('torch.', '')}, {kind})" for ids, dtype, kind in buckets[:4])
    more = f", +{len(buckets) - 4} more" if len(buckets) > 4 else ""
    return f"schedule {mine['schedule']}, {len(buckets)} buckets [{sizes}{more}], compression {mine['compression']}"


class _OutsideProcessSet(torch.optim.Optimizer):
    """A ``DistributedOptimizer`` on a rank outside its ``process_set``: as in Horovod it registers no
    hooks, ``synchronize()`` has nothing to wait for and ``step()`` is the wrapped optimizer's local step."""

    def __init__(self, params, named_parameters, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        self._parameter_names = parameter_names(named_parameters, [p for g in self.param_groups for p in g["params"]])
        self._passes = backward_passes_per_step
        self._delay: dict = {}
        self._synchronized = False
        self._should_synchronize = True

    def synchronize(self) -> None:
        self._synchronized = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        """Nothing to release: a rank outside the process set holds no communicator."""


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         check_finite: bool | str | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks (Horovod's API).

    The result is an instance of a subclass of ``optimizer``'s class built from its
    ``param_groups`` (``isinstance`` and LR schedulers keep working; the original's state is not
    carried over, as in Horovod). ``check_finite`` (gpucomm's; default ``GPUCOMM_CHECK_FINITE``):
    ``"raise"``/True or ``"warn"`` names, on every rank in the same step, the rank and parameter
    whose gradient first went NaN or Inf (``finite_check.py``)."""
    compression = resolve_compression(compression)  # Compression.powersgd without its call: its defaults
    if op == Adasum:  # Horovod's delta optimizer (gpucomm/torch/adasum.py)
        if isinstance(compression, PowerSGD):
            raise NotImplementedError("Compression.powersgd is not supported with op=hvd.Adasum (its delta optimizer "
                                      "reduces weight changes, not gradients, in one request); use op=hvd.Average or "
                                      "hvd.Sum, or Compression.fp16 / bf16 with Adasum.")
        if finite_check.resolve_mode(check_finite) in finite_check.MODES:  # asked for (the default is off here)
            raise NotImplementedError("check_finite is not supported with op=hvd.Adasum (its delta optimizer "
                                      "reduces weight changes, not gradients); use op=hvd.Average or hvd.Sum.")
        if current_job().world.size > 1:
            return adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                    gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        op = Sum  # one rank: the Adasum of one rank's gradients is those gradients
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op must be hvd.Average or hvd.Sum, got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_passes(backward_passes_per_step)
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if isinstance(process_set, ProcessSet) and process_set.included() is False:  # registered, without this rank
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {**_OutsideProcessSet.__dict__, **shared_steps()})
        return cls(optimizer.param_groups, named_parameters, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {**_DistributedOptimizer.__dict__, **shared_steps()})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, check_finite)


def ZeroRedundancyOptimizer(params: Any, optimizer_class: type | None = None, *,
                            named_parameters: Iterable | None = None,
                            overlap_with_forward: torch.nn.Module | None = None,
                            backward_passes_per_step: int = 1, op: int = Average,
                            gradient_predivide_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                            check_finite: bool | str | None = None, elementwise: bool | None = None,
                            **defaults: Any) -> torch.optim.Optimizer:
    """ZeRO stage 1: ``optimizer_class`` built on ``params`` with ``defaults`` (``lr=...``), its state
    sharded across the ranks (each keeps 1/N), gradients reduce-scattered in buckets while backward
    runs and the updated parameters allgathered after ``step()`` (``zero.py``). Torch's argument
    order ``(params, optimizer_class, **defaults)``; ``(optimizer_class, params, ...)`` works too.

    Why a class of its own rather than a ``DistributedOptimizer`` option: its contract differs where
    users look (``state_dict()`` is a collective that gathers every rank's shard, with torch's
    ``consolidate_state_dict(to=0)``; ``load_state_dict`` takes a full state and re-shards it;
    ``synchronize()`` leaves the averaged gradients in the optimizer's shards, not in ``p.grad``),
    and torch users know it by this name. The hooks, buckets, schedule, accumulation
    (``backward_passes_per_step``), ``hvd.join`` and ``check_finite`` are DistributedOptimizer's.
    ``overlap_with_forward=model``: the parameter allgathers are left in flight after ``step()`` and
    each layer's forward (or ``model.state_dict()``) waits for its own, so they overlap the next
    forward; read parameters elsewhere only after ``opt.wait_parameters()``. Without it, ``step()``
    waits for them. ``elementwise``: declare that an optimizer class outside
    ``zero.ELEMENTWISE`` updates each element on its own (sharding is flat). The result is an
    instance of ``optimizer_class``; ``.optim`` is the optimizer of this rank's shard."""
    if isinstance(params, type) and issubclass(params, torch.optim.Optimizer):
        params, optimizer_class = optimizer_class, params  # Horovod-style order
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"ZeroRedundancyOptimizer(params, optimizer_class, **defaults): optimizer_class must be a "
                        f"torch.optim.Optimizer subclass such as torch.optim.Adam, got {optimizer_class!r}.")
    check_elementwise(optimizer_class, elementwise)
    check_closure_free(optimizer_class)
    if op not in (Average, Sum):
        raise ValueError(f"ZeroRedundancyOptimizer op must be hvd.Average or hvd.Sum, got {op!r}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_passes(backward_passes_per_step)
    base = optimizer_class(params, **defaults)  # the parameter groups with their options (no state yet)
    if isinstance(process_set, ProcessSet) and process_set.included() is False:
        cls = type(optimizer_class.__name__, (optimizer_class,), {**_OutsideProcessSet.__dict__, **shared_steps()})
        return cls(base.param_groups, named_parameters, backward_passes_per_step)
    settings = ZeroSettings(optimizer_class, dict(defaults), overlap_with_forward)
    cls = type(optimizer_class.__name__, (optimizer_class,), {**_DistributedOptimizer.__dict__, **shared_steps(),
                                                              **sharded_steps(), "_zero_settings": settings})
    # sparse gradients are densified into the buckets: every rank's part is dense
    return cls(base.param_groups, named_parameters, Compression.none, backward_passes_per_step, op,
               gradient_predivide_factor, None, True, process_set, check_finite)


__all__ = ["DistributedOptimizer", "ZeroRedundancyOptimizer"]
