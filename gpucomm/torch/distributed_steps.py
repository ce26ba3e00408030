"""The methods of the optimizer ``DistributedOptimizer`` returns: ``DistributedSteps`` (built,
a step's reduction and its settling, ``zero_grad`` and the state dict) with its concerns' mixins
(``gradient_hooks``, ``layout_agreement``, ``replanning``, ``finite_reports``, ``job_binding``),
merged into one namespace (``distributed_steps()``) for the dynamic subclass of the user's
optimizer class. ``ZeroRedundancyOptimizer`` merges ``zero_steps.ShardedSteps`` over it.

Why a namespace and not base classes: the dynamic class subclasses the user's optimizer class
alone (``isinstance`` and LR schedulers keep working), and its methods must override that class's
``step``, ``zero_grad`` and state dict, so they sit in the class itself.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import torch

from ..counters import COUNTERS
from ..errors import CollectiveError
from ..process_sets import ProcessSet
from . import finite_check
from .compression import PowerSGD
from .finite_reports import FiniteReports
from .gradient_hooks import GradientHooks
from .job_binding import JobBinding
from .layout_agreement import LayoutAgreement
from .parameters import ZERO_GRAD_ERROR, parameter_names
from .powersgd import PowerSGDState
from .replanning import Replanning
from .submission import active_job, current_job


class DistributedSteps(torch.optim.Optimizer):
    """Mixed into a dynamic subclass of the user's optimizer class; see ``DistributedOptimizer``.
    ``ZeroRedundancyOptimizer`` merges ``zero_steps.ShardedSteps`` over it (``_prepare``,
    ``_bucket_maker``, ``_settle_parameters`` and ``_tunable`` are the points it changes)."""

    _tunable = True  # autotune may re-cut the buckets
    _kind = "DistributedOptimizer"  # what errors call this optimizer
    _reduces_at_one_rank = True  # GPUCOMM_ONE_RANK_REDUCER may run the schedule at size 1

    def __init__(self, params: Any, named_parameters: Iterable | None, compression: Any, backward_passes_per_step: int,
                 op: int, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool, process_set: ProcessSet,
                 check_finite: bool | str | None = None) -> None:
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
        self._by_order = False  # hooked by arrival order (``gradient_hooks``): one Python hook per bucket
        self._order_thread = 0  # the thread whose step() turned hooks by arrival order on (``gradient_hooks``)
        self._step_verdict: str | None = None  # what the last step by arrival order found (``_settle_hooks``)
        self._lock = threading.Lock()  # hooks of CPU and CUDA parameters run on different autograd threads
        self._job_ref: Any = None
        self._schedule: Any = None
        self._closed = False
        self._in_backward = False  # this step's backward is running (a flush from another thread waits)
        self._backward_cv = threading.Condition()
        self._hooked = False  # a gradient hook fired since the last synchronize
        self._step_launched = False  # this step's launches are all made (a flush, or synchronize)
        self._prepare()
        self._bind(current_job())

    def _prepare(self) -> None:
        """What a merged class sets up before the layout is first agreed (DistributedOptimizer: nothing)."""

    def _settle_parameters(self) -> None:
        """Before ``zero_grad`` and ``close``: parameters still being written are written (DistributedOptimizer:
        none are)."""

    def synchronize(self) -> None:
        """Finish averaging every gradient: launch the buckets not yet launched, wait for all in
        order, and write the averaged gradients into ``p.grad``."""
        if self._reduce_step():
            self._settle_step()
            self._settle_hooks()

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
            if not self._step_launched:  # (a flush may have launched it all already)
                self._launch_step()
        try:
            reports = self._buckets.finish(self._steps + 1)
            self._sparse.finish()
            order = None if self._by_order else self._buckets.arrival_order()
            self._recorded_order = (self._buckets, order) if order is not None else None
        finally:
            self._step_verdict = self._order_verdict  # (by arrival order) judged at the end of synchronize
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
        """After a step's reduction: the finite check's report, then the first re-cut, autotune, a changed
        layout. The report comes first: its slots name buckets of the layout that produced them (a re-cut
        read them against the new one: the wrong parameter, or an IndexError). Every rank reports alike, so
        when one raises, all do, and each still runs the layout's collectives (``finally``)."""
        reports, self._pending_reports = self._pending_reports, []
        try:
            self._report_checks(reports)
        finally:
            if not self._replan():  # a re-cut agreed the layout (and the sparse parameters) just now
                if self._sparse.due and self._sparse.agree():
                    self._adopt_new_layout(sparse_agreed=True)
                elif self._layout_changed():
                    self._adopt_new_layout()
            self._sparse.hand_back()

    def _reset_step(self) -> None:
        self._hooked = False
        self._step_launched = False
        self._tracer = None
        self._backward_ended()  # also when backward raised before its final callback
        self._buckets.reset()
        self._sparse.reset()
        self._delay = dict.fromkeys(self._delay, self._passes)
        self._step_opened = False
        self._order_verdict = None

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the new parameters are averaged as the others: they join the agreed layout at the
        end of the next step's reduction (a collective: add the group at the same point on every rank),
        and that step's gradients of theirs are averaged then. Horovod leaves such parameters out of its
        hooks, so each rank stepped them on its own gradients and the replicas drifted apart silently."""
        built = "_buckets" in self.__dict__  # torch's __init__ adds the first groups before ours runs
        if built and (self._powersgd is not None or self._kind != "DistributedOptimizer"):
            what = "with PowerSGD compression" if self._powersgd is not None else f"to a {self._kind}"
            raise ValueError(
                f"{self._kind}: adding a parameter group after it was built is not supported {what}: the new "
                f"parameters would not be reduced, and each rank would step them on its own gradients. Build the "
                f"optimizer with every group; a layer to train later can be in it from the start with "
                f"requires_grad=False (it is averaged once it is unfrozen).")
        super(self.__class__, self).add_param_group(param_group)
        if built:
            self._add_parameters(len(self.param_groups) - 1)

    def _add_parameters(self, group: int) -> None:
        """The parameters of ``param_groups[group]`` new to this optimizer join it: named after their place
        (the same on every rank), in ``_params``; the layout changes at the next step's end."""
        known = set(self._params)
        new = [p for p in self.param_groups[group]["params"] if p not in known]
        for j, p in enumerate(new):
            self._parameter_names[p] = f"param_group.{group}.{j}"
        self._params.extend(new)
        self._sparse.add(new)
        if self._ready_us is not None:  # the watched step never saw them: taken as ready last
            self._ready_us.extend([None] * len(new))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Horovod's guard, then the gradients cleared as torch does: ``set_to_none=True`` (the
        default) frees them (the next step's buckets pack the new ones in, once each); with
        ``set_to_none=False`` gradients that live in their buckets (bound views of the fusion
        buffers) are zeroed where they live, one op per bucket, and backward accumulates into the
        buffer again with no copy at all (DDP's ``gradient_as_bucket_view``). With
        ``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS=1`` the default does the same for those gradients: they stay
        their views, zeroed, instead of becoming None."""
        if self._gradients_came() or self._buckets.in_flight or self._sparse.in_flight:
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
        if self._buckets.in_flight or self._sparse.in_flight or self._step_opened or self._gradients_came():
            try:
                self.synchronize()  # finish what is in flight; the gradients are discarded by the caller's next step
            except CollectiveError:
                pass  # the job broke (an elastic restore follows): nothing in flight is worth keeping
        self._reset_step()
        state_dict = dict(state_dict)
        powersgd = state_dict.pop("powersgd", None)
        if powersgd is not None and self._powersgd is not None:
            self._powersgd.load_state_dict(powersgd)
        return super(self.__class__, self).load_state_dict(state_dict)


CONCERNS = (GradientHooks, LayoutAgreement, Replanning, FiniteReports, JobBinding)


def distributed_steps() -> dict:
    """``DistributedSteps``' methods (its ``__init__`` and docstring too) and its concerns', for a
    dynamic class's namespace (its ``__module__`` is then the module that builds the class)."""
    namespace = {k: v for k, v in DistributedSteps.__dict__.items() if k != "__module__"}
    for mixin in CONCERNS:
        namespace.update({k: v for k, v in mixin.__dict__.items() if not k.startswith("__")})
    return namespace


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


__all__ = ["CONCERNS", "DistributedSteps", "distributed_steps"]
