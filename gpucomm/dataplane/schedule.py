"""A fixed schedule: one DistributedOptimizer's collectives (its bucket allreduces, its sparse
gradients' allgathers), launched in the same order on every rank with no control-plane message.

Agreement happens once, when the optimizer verifies its parameters and buckets across ranks; from
then on every rank issues the same collectives in the same order by construction. The schedule
runs on a group of its own (its own Gloo process group, or NCCL communicator and stream), so its
collectives never pair with negotiated ones. A training step is a *step* of the schedule
(``begin_step``/``end_step``): an epoch of each CUDA device's issue order (``order.py``), which
places the step's NCCL calls among the negotiated ones the same way on every rank.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..counters import COUNTERS
from ..errors import CollectiveError
from .groups import Group
from .handles import Handle
from .requests import Request
from . import cuda_calls
from .executor import prepare

if TYPE_CHECKING:
    from .plane import DataPlane

# s a wait on a step's transfers blocks before the job is told: long enough that a healthy step, whose last
# transfers may take a while after backward, sends no control message (the steady state sends none)
BLOCKED_AFTER = 5.0


class Schedule:
    """Launches requests on ``group`` in the order given; the caller keeps that order the same on
    every rank. ``plane`` is the job's data plane (executor, events, watchdog, issue orders,
    failure); the schedule touches nothing of the control plane."""

    def __init__(self, group: Group, plane: DataPlane, *, number: int = 0) -> None:
        self.group = group
        self.number = number
        self.timeout = plane.timeout
        self._plane = plane
        self._executor = plane.executor(lambda set_id: group)
        self._devices: list[torch.device] = []
        self._epochs: list[tuple[Any, int]] | None = None  # the open step: (issue order, token) per device
        self._waiting_since: float | None = None  # a wait on this schedule's transfers blocks (first poll)
        self._told = False  # ... and the job was told (``DataPlane.in_step``)
        self.launches = 0  # collectives launched so far (the same sequence on every rank: the schedule is fixed)
        plane.register(group)

    def open(self, device: torch.device) -> None:
        """Build the group's backend for ``device`` now (a collective call: every member builds it
        at the same point), so the first step does not pay for it inside backward."""
        if device not in self._devices:
            self._devices.append(device)
        if cuda_calls.is_gpu(device):
            self.group.nccl()
        else:
            self.group.cpu_backend()

    # -- steps -------------------------------------------------------------------------------------
    def begin_step(self, flush: Callable[[], None]) -> None:
        """Open the step on every device of the schedule (no-op when open): negotiated collectives
        this rank submitted before are issued first. ``flush()`` launches the rest of the step and
        ends it (run when a caller outside backward needs the devices' queues)."""
        if self._epochs is not None:
            return
        epochs = []
        try:
            for device in self._devices:
                order = self._plane.order(device)
                if order is not None:
                    epochs.append((order, order.open_epoch(flush)))
        except BaseException:
            for order, token in epochs:
                order.close_epoch(token)
            raise
        self._epochs = epochs

    def open_before_negotiated(self, opener: Callable[[], None] | None) -> None:
        """While set, ``opener()`` (a bound method of the step's owner) runs before this rank submits a
        negotiated collective. Its owner opens the step there when gradients of it have come yet nothing
        opened it (hooks by arrival order: most gradients' hooks are C calls, which open nothing), so
        the collective is placed after the step's collectives, as on a rank whose backward opened it."""
        self._plane.set_step_opener(self, opener)

    def end_step(self) -> None:
        """Close the step: its launches' done event is recorded (watched from now), and negotiated
        work that waited for the step is issued."""
        self._executor.seal_step()
        epochs, self._epochs = self._epochs, None
        for order, token in epochs or ():
            order.close_epoch(token)

    @property
    def in_step(self) -> bool:
        return self._epochs is not None

    def launch(self, request: Request, meta: dict | None = None, *, per_step: bool = False) -> Handle:
        """Issue ``request`` now, on the caller's thread (``meta``: what a coordinator would add,
        e.g. the ranks' first dimensions of an allgather). ``per_step``: a CUDA launch is completed
        by the step's one done event (a backward bucket, waited for in order by ``synchronize``),
        else by one of its own (a launch waited for on its own, e.g. ZeRO's parameter allgathers)."""
        failure = self._plane.failure()
        if failure is not None:  # its communicators were aborted: say why, not NCCL's "invalid argument"
            raise failure
        self.launches += 1  # numbered per launch, not per step: where a step ends may differ between ranks (a flush)
        request.step = (self.group.id, self.number, self.launches)
        calls = cuda_calls.calls()
        if request.device.type in calls.gpu_types:
            request.index = calls.index(request.device)
            request.stream = calls.current_stream(request.device)
            request.per_step = per_step
            prepare(request)  # before the ready event: the communication stream must see its work
            request.ready_event = self._plane.events.record(request.stream, request.index)
        else:
            prepare(request)
        try:
            issued = self._executor(request, meta or {})
        except Exception:
            failure = self._plane.failure()
            if failure is not None:  # aborted while this launch ran (another thread): that is why it failed
                raise failure from None
            raise
        return Handle(request, self, issued)

    # -- the handle owner's side ---------------------------------------------------------------
    def transport_hint(self) -> str:
        """Why a transfer of this schedule may fail with no failure named anywhere: a rank that does not
        run the same step (nothing is negotiated, so no stall warning or deadlock check sees it)."""
        return (f". This collective is a step of a DistributedOptimizer's fixed schedule: every rank of its "
                f"process set runs the same bucket collectives in the same order, with no negotiation, so a rank "
                f"that does not run this step leaves the others waiting in it until the transfer fails or "
                f"GPUCOMM_TIMEOUT ({self.timeout:.0f} s) ends it. Likely causes: a rank ran fewer batches or skipped "
                f"optimizer.step() (uneven data: call hvd.join() on the ranks that finish first), a rank is stuck "
                f"outside gpucomm (data loading, a deadlock in the training script), or a collective that only some "
                f"ranks run between backward() and step(). The other ranks' errors say where each one was")

    def wait_ready(self, handle: Handle, timeout: float) -> None:
        raise CollectiveError(f"internal error: {handle.request.describe()} was never issued on its fixed "
                              f"schedule; please report this as a gpucomm bug.")

    def launches_record(self) -> tuple[int, int, int]:
        """(set id, number, collectives launched): what a rank that shuts down tells the others of this schedule."""
        return self.group.id, self.number, self.launches

    def departure(self, request: Request) -> str | None:
        """Why ``request`` cannot complete: a member of the set shut gpucomm down before it launched this
        collective (None: none did). Exact, with no grace: a collective every member launched completes.
        What the waiting rank is told instead of a transport error or a timeout."""
        return self._plane.departure(self.group.ranks, request.step)

    def departed_failure(self, error: CollectiveError) -> None:
        """A step failed because a member of the set shut gpucomm down: this rank's job cannot go on, and
        the transfer it waited for may never end (MPI, NCCL): fail the data plane, so that shutdown
        aborts the communicators instead of waiting for that transfer for GPUCOMM_TIMEOUT."""
        self._plane.fail(error)

    def failure(self) -> CollectiveError | None:
        return self._plane.failure()

    def blocked_poll(self, request: Request | None = None) -> CollectiveError | None:
        """The job's failure, as polled (every 0.2 s) by a wait on this schedule's host transfers while it
        blocks (``Handle.wait``; ``wait_ended`` follows): one blocked for ``BLOCKED_AFTER`` s is told to the
        job, and rank 0's stall inspector warns about it (a step is never negotiated: nothing else would
        say its peers do not run it)."""
        now = time.monotonic()
        since = self._waiting_since
        if since is None:
            self._waiting_since = now
        elif not self._told and now - since >= BLOCKED_AFTER:
            self._told = True
            COUNTERS.step_waits_reported += 1
            self._plane.in_step(f"a step of DistributedOptimizer schedule {self.number} (process set {self.group.id})")
        failure = self._plane.failure()
        if failure is None and request is not None:
            gone = self._plane.departure(self.group.ranks, request.step)
            if gone is not None:  # a transfer that needs a rank gone for good: end the wait (no reset may come)
                return CollectiveError(gone)
        return failure

    def wait_ended(self) -> None:
        """A wait on this schedule's transfers returned (or raised)."""
        self._waiting_since = None
        if self._told:
            self._told = False
            self._plane.in_step(None)

    def seal(self) -> None:
        """The launches so far (a backward has ended) get their done event now, so the watchdog
        watches them before anything waits: a host blocked on the GPU meanwhile (a device sync, the
        allocator freeing memory) with a dead peer is reported, never left hanging."""
        self._executor.seal_step()

    @property
    def has_peers(self) -> bool:
        """Whether another rank takes part (a failed transfer may then be another rank's failure)."""
        return self.group.size > 1

    def close(self) -> None:
        """Release the schedule's communicators (a collective point: every member calls it)."""
        self._plane.set_step_opener(self, None)
        self.end_step()
        self._executor.close()
        self._plane.release(self.group)
        self._executor.destroy_streams()


__all__ = ["Schedule"]
