"""The job's data plane in this process: what turns agreed collectives into backend calls, and what
owns the steady state.

It holds the job's pooled CUDA events, the NCCL watchdog (which also retires done events), one
issue order per device (``order.py``: one order of NCCL calls per device, the same on every rank),
and every group with backends (the job's process sets and the optimizers' fixed schedules), whose
communicators it releases: aborted, never destroyed, once the job has failed; destroyed only at a
collective point of a healthy job (``close`` at shutdown, ``release`` for an optimizer's explicit
close), after their work has finished. A steady-state step goes from the optimizer to a fixed
schedule to this plane and touches no control-plane object. The control plane hands agreed
requests to ``run`` and tells ``fail`` when the job failed.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Iterable

import torch

from ..backends.nccl import nccl_module, nccl_version
from ..errors import CollectiveError, ShutdownError
from ..settings import ISSUE_ORDER
from . import cuda_calls
from .events import EventPool
from .executor import Executor
from .groups import Group
from .handles import Handle, Issued
from .order import IssueOrder
from .requests import Request
from .watchdog import NcclWatchdog

log = logging.getLogger("gpucomm")

REPORT_FIRST = 2.0  # seconds the watchdog's failure report may take before the abort goes ahead without it
ORDER_ENV = ISSUE_ORDER.names[0]  # "cuda" (default): order CUDA collectives; "all": CPU ones too (tests, debugging)


class DataPlane:
    """One job's data plane (see the module doc).

    ``tracer()``: the timeline's tracer while one records; ``select_device()``: makes this rank's
    GPU current in the calling thread (every thread of the data plane runs it first);
    ``report(text)``: tells the control plane this rank is failing (so every rank learns it);
    ``in_step(what)``: tells it a fixed schedule's step blocks in a transfer (None: no longer);
    ``departed()``: the ranks that shut gpucomm down, each with how many collectives of each fixed schedule
    it launched (``{(set id, number): launches}``), as it told rank 0 when it left."""

    def __init__(self, rank: int, timeout: float, *, tracer: Callable[[], Any] = lambda: None,
                 select_device: Callable[[], None] = lambda: None,
                 report: Callable[[str], None] = lambda text: None, order_cpu: bool | None = None,
                 in_step: Callable[[str | None], None] = lambda what: None,
                 departed: Callable[[], dict[int, dict]] = dict) -> None:
        self.rank, self.timeout = rank, timeout
        self.in_step = in_step  # a fixed schedule's step blocks in a transfer (what), or no longer (None)
        self._departed = departed
        self.events = EventPool()
        self._tracer = tracer
        self.select_device = select_device
        self._report = report
        self._failure: CollectiveError | None = None
        self._groups: list[Group] = []
        self._orders: dict[Any, IssueOrder] = {}
        self._lock = threading.Lock()
        if order_cpu is None:
            order_cpu = ISSUE_ORDER.read(None, "cuda") == "all"
        self.orders_cpu = order_cpu
        # schedule -> its step's opener (weakly: a bound method of the optimizer), run before this rank submits
        # a negotiated collective; ``step_openers`` counts them (read on every submission; 1 while a plain
        # DistributedOptimizer hooks by arrival order, the default: its opener then adds about 4 Python calls per op)
        self._step_openers: dict[Any, weakref.WeakMethod] = {}
        self.step_openers = 0
        self.watchdog = NcclWatchdog(rank, timeout, self.events, health=self._health, fail=self._watchdog_failed,
                                     select_device=select_device, departed=self._request_departure)

    # -- executing ------------------------------------------------------------------------------
    def executor(self, groups: Callable[[int], Group]) -> Executor:
        """An executor over ``groups`` (set id -> Group) sharing this plane's events and watchdog."""
        return Executor(groups, self._tracer, events=self.events, watch=self.watchdog.watch,
                        host_calls=self.watchdog.host_calls, start_watch=self.watchdog.start)

    def order(self, device: torch.device) -> IssueOrder | None:
        """The issue order of ``device`` (None: its collectives are issued as they come, CPU ones
        unless GPUCOMM_ISSUE_ORDER=all)."""
        if not cuda_calls.is_gpu(device) and not self.orders_cpu:
            return None
        key = (device.type, device.index)
        order = self._orders.get(key)
        if order is None:
            with self._lock:
                order = self._orders.get(key)
                if order is None:
                    order = self._orders[key] = IssueOrder(str(device), timeout=self.timeout, failure=self.failure)
                    if self._failure is not None:
                        order.fail(self._failure)
        return order

    def set_step_opener(self, schedule: Any, opener: Callable[[], None] | None) -> None:
        """``opener()`` (a bound method, held weakly; None: no more) runs before this rank submits a
        negotiated collective: it opens ``schedule``'s step where gradients of it have come though
        nothing opened it yet (``Schedule.open_before_negotiated``)."""
        with self._lock:
            if opener is None:
                self._step_openers.pop(schedule, None)
            else:
                self._step_openers[schedule] = weakref.WeakMethod(opener)
            self.step_openers = len(self._step_openers)

    def open_steps(self) -> None:
        """(before this rank submits a negotiated collective, on the submitting thread) Run the step
        openers: a step whose gradients came is opened first, so the collective is placed after it
        here as on the ranks whose backward opened it."""
        dead = False
        for ref in list(self._step_openers.values()):
            opener = ref()
            if opener is None:  # its optimizer was dropped without close(): stop counting it
                dead = True
            else:
                opener()
        if dead:
            with self._lock:
                for schedule, ref in list(self._step_openers.items()):
                    if ref() is None:
                        del self._step_openers[schedule]
                self.step_openers = len(self._step_openers)

    def submitted(self, handle: Handle) -> None:
        """This rank submitted ``handle`` for negotiation (its device's next epoch waits for its agreement)."""
        order = self.order(handle.request.device)
        if order is not None:
            order.submitted(handle)

    def run(self, handle: Handle, meta: dict, execute: Executor) -> None:
        """``handle``'s request is agreed (``meta``: the coordinator's additions): issue it through
        ``execute`` now, or in its device's order, and settle the handle."""
        if not self.orders_cpu and not cuda_calls.is_gpu(handle.request.device):  # the CPU hot path: no order
            issue_and_settle(handle, meta, execute, self.failure)
            return
        self.order(handle.request.device).agreed(
            handle, lambda: issue_and_settle(handle, meta, execute, self.failure))

    def run_unowned(self, request: Request, meta: dict, execute: Executor, keep: Callable[[Issued], None]) -> None:
        """Issue a request nobody waits on (a joined rank's zeros), in its device's order; ``keep``
        receives what was issued (to keep its tensors alive until it finishes)."""
        order = self.order(request.device)

        def issue() -> None:
            keep(execute(request, meta))

        if order is None:
            issue()
        else:
            order.agreed(None, issue)

    # -- groups and their communicators ---------------------------------------------------------
    def register(self, group: Group) -> Group:
        """Track ``group``'s communicators (aborted on failure, released at close)."""
        with self._lock:
            self._groups.append(group)
        if self._failure is not None:
            group.abort_nccl()
        return group

    def release(self, group: Group) -> None:
        """Release ``group`` at a collective point of its members (a removed process set, an
        optimizer's close): destroyed once its work has finished, aborted if the job failed."""
        drained = self.watchdog.drain(self.timeout)  # first: a failure found meanwhile is seen below
        with self._lock:
            if group in self._groups:
                self._groups.remove(group)
        group.close(abort=not drained or self._failure is not None)

    def _health(self, set_id: int) -> str | None:
        """NCCL's asynchronous error on ``set_id``'s communicators, if any."""
        if self._failure is not None:
            return None  # aborted: nothing more to learn from them
        with self._lock:
            groups = [g for g in self._groups if g.id == set_id]
        for group in groups:
            backend = group.nccl_if_created()
            if backend is None:
                continue
            try:
                backend.check_async_error()
            except Exception as e:  # noqa: BLE001 - reported as the job's failure
                return str(e)
        return None

    def departure(self, ranks: Iterable[int], step: tuple[int, int, int] | None) -> str | None:
        """Why fixed-schedule launch ``step`` ((set id, schedule number, index)) over ``ranks`` cannot complete:
        some of them shut gpucomm down having launched fewer of that schedule's collectives (what each told
        rank 0 as it left; a collective it launched completes, however late). The sentence naming the first of
        them to leave (the others may have left because of it: a rank whose step failed shuts down as it
        exits), or None; None for what is not a schedule's launch."""
        gone = self._departed()
        if not gone or step is None:
            return None
        key, index = step[:2], step[2]
        members = set(ranks)
        # one snapshot, in the order this rank learnt of them (the control thread may add one meanwhile)
        names = [r for r, launched in list(gone.items())
                 if r in members and r != self.rank and launched.get(key, 0) < index]
        if not names:
            return None
        later = f" (then {'rank' if len(names) == 2 else 'ranks'} {', '.join(map(str, names[1:]))} too)" \
            if len(names) > 1 else ""
        return (f"rank {names[0]} shut gpucomm down (hvd.shutdown(), or its script ended) while this rank still "
                f"needed it in this collective{later}. A DistributedOptimizer step is a fixed schedule: every rank "
                f"of its process set runs the same bucket collectives in the same order, so that rank ran fewer "
                f"steps than this one. If the ranks' data is uneven, call hvd.join() on the ranks that finish first "
                f"(it stands in for their missing steps); else give every rank the same number of batches")

    def _request_departure(self, request: Request) -> str | None:
        """(the watchdog) ``departure`` for a watched collective (None at once while no rank has left)."""
        if not self._departed():
            return None
        step = getattr(request, "step", None)  # (whatever the watchdog was given to describe the collective)
        if step is None:
            return None
        with self._lock:
            group = next((g for g in self._groups if g.id == request.set_id), None)
        return self.departure(group.ranks, step) if group is not None else None

    # -- failure ---------------------------------------------------------------------------------
    def failure(self) -> CollectiveError | None:
        """Why the job's collectives stopped, as far as the data plane knows."""
        return self._failure

    def fail(self, error: CollectiveError) -> None:
        """The job failed (told by the control plane, or found by the watchdog): abort every NCCL
        communicator at once, so no kernel keeps waiting for a dead peer, and fail queued work."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            groups, orders = list(self._groups), list(self._orders.values())
        # in this order: a thread issuing a negotiated collective holds its order's lock while NCCL's host
        # call may wait for a peer that died (lazy connection); only the abort frees it, so the orders stop
        # issuing first without their locks, then the abort, then their queued handles fail under their locks
        for order in orders:
            order.stop(error)
        _abort_together([g for g in groups if g.nccl_if_created() is not None], self.select_device)
        for order in orders:
            order.fail(error)

    def _watchdog_failed(self, text: str) -> None:
        """The watchdog found the job broken: tell every rank, then abort here. The report goes first,
        so that the other ranks name this cause rather than what the abort does to them, but on a
        thread of its own, waited for up to ``REPORT_FIRST`` seconds: the control plane's lock may be
        held by a thread blocked inside NCCL, which only the abort frees."""
        reported = threading.Event()

        def report() -> None:
            try:
                self._report(text)
            except Exception as e:  # noqa: BLE001 - the failure is recorded here whatever the control plane does
                log.debug("reporting the watchdog's failure: %s", e)
            finally:
                reported.set()

        threading.Thread(target=report, name="gpucomm-failure-report", daemon=True).start()
        reported.wait(REPORT_FIRST)
        self.fail(CollectiveError(text))

    # -- shutdown --------------------------------------------------------------------------------
    def close(self, *, failed: bool) -> None:
        """Release every communicator: a healthy job (``failed`` False) first waits up to the
        timeout for its CUDA work to finish, then destroys them; a failed one (or one whose work
        does not finish) aborts them."""
        if not failed and not self.watchdog.drain(self.timeout):
            found = self.watchdog.failure
            if found is not None:  # drain gave up at once: the work had failed, it was not slow
                log.warning("gpucomm shutdown: the job's CUDA work had failed (%s); aborting the NCCL communicators "
                            "instead of destroying them", found)
            else:
                log.warning("gpucomm shutdown: CUDA collectives were still running after %.0f s (GPUCOMM_TIMEOUT); "
                            "aborting the NCCL communicators instead of destroying them", self.timeout)
            failed = True
        if failed and self._failure is None:
            self.fail(CollectiveError("the job was shut down while CUDA collectives were still running"))
        self.watchdog.close()
        with self._lock:
            groups, self._groups = self._groups, []
            orders = list(self._orders.values())
        for order in orders:  # nothing queued may wait for an issue that will never come
            order.fail(ShutdownError("gpucomm was shut down while this collective waited for its turn on the GPU"))
        for group in groups:
            group.close(abort=failed or self._failure is not None)
        if not failed and self._failure is None:
            self.events.close()  # a failed job's events may still be waited on by aborted work: left to the process


def issue_and_settle(handle: Handle, meta: dict, execute: Executor,
                     failure: Callable[[], BaseException | None] = lambda: None) -> None:
    """Issue ``handle``'s agreed request through ``execute`` and settle the handle with what was issued,
    or with the error, which belongs to whoever waits on the handle (never to the issuing thread): the
    job's ``failure()`` when there is one by then (an abort by another thread makes NCCL's call fail with
    its own, misleading, error)."""
    try:
        issued = execute(handle.request, meta)
    except BaseException as e:  # noqa: BLE001 - the error belongs to whoever waits on the handle
        handle.settle(error=failure() or e)
        return
    handle.settle(issued=issued)


def _abort_together(groups: list[Group], select_device: Callable[[], None]) -> None:
    """Abort the communicators of ``groups`` in one NCCL group call where NCCL has one (2.22+): one
    by one, aborting the first can wait, in a device synchronisation, behind another one's kernel
    stuck on a dead peer (NVIDIA/nccl#1013). The caller may be any thread: select the GPU first."""
    if not groups:
        return
    try:
        select_device()
    except Exception as e:  # noqa: BLE001 - aborting matters more than which device is current
        log.debug("selecting the GPU before aborting: %s", e)
    nccl = nccl_module() if len(groups) > 1 and nccl_version() >= 22200 else None
    if nccl is not None:
        nccl.groupStart()
    try:
        for group in groups:
            group.abort_nccl()
    finally:
        if nccl is not None:
            try:
                nccl.groupEnd()
            except Exception as e:  # noqa: BLE001 - each abort already ended its communicator's state
                log.debug("NCCL group abort: %s", e)


__all__ = ["DataPlane", "ORDER_ENV", "issue_and_settle"]
