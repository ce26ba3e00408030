"""Handles: what a submitted collective gives its caller, from submission to result.

A handle is *agreed* when its owner knows what runs (at once in a one-rank job or on a fixed
schedule, after negotiation otherwise). An agreed handle is either *issued* (handed to a backend)
or *queued* in its device's issue order (``order.py``: CUDA work waits there for a point that is
the same on every rank), or it *failed*. ``wait`` waits for agreement (its owner drives that),
issues a queued handle in order, waits for the backend's work and produces the result. Owners
settle handles through ``settle`` / ``queue``, never by writing their fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from ..errors import CollectiveError, ShutdownError
from . import cuda_calls

CAUSE_GRACE = 2.0  # seconds a broken collective waits for the control plane to name why (a peer's death)


@dataclass
class Issued:
    """What the backend has in flight for one request, and how to turn it into the result."""

    works: Sequence[Any] = ()  # host-completed backend works (Gloo, MPI)
    done_event: Any = None  # stream-ordered completion (a raw CUDA event), or None
    finalize: Callable[[], Any] = lambda: None  # runs once, after completion, on the waiting thread
    results_on_comm: bool = False  # CUDA results allocated on the communication stream
    release_done: Callable[[], None] | None = None  # the waiter has enqueued its wait on ``done_event``
    done_stream: int = 0  # the raw stream ``done_event`` is recorded on (a waiter on it needs no wait)
    covered: Any = None  # a fixed schedule's launch: its step's one done event completes it (``completion``)


class HandleOwner(Protocol):
    """What a handle asks of its owner (the controller, the one-rank runner or a fixed schedule). An
    owner may also say ``has_peers`` (default True: a failed transfer may be another rank's failure)."""

    timeout: float

    def wait_ready(self, handle: Handle, timeout: float) -> None:
        """Block until ``handle`` is agreed (issued, queued or failed), or raise."""

    def failure(self) -> CollectiveError | None:
        """The job's failure as the control plane names it, or None."""


class Handle:
    """One submitted request: ``poll`` never blocks; ``wait`` returns the result or raises.

    A handle is waited on by one thread (``synchronize`` hands it out once)."""

    __slots__ = ("request", "_issued", "_error", "_result", "_finished", "_owner", "_queued")

    def __init__(self, request: Any, owner: HandleOwner, issued: Issued | None = None) -> None:
        self.request, self._owner = request, owner
        self._issued: Issued | None = issued
        self._error: BaseException | None = None
        self._result: Any = None
        self._finished = False
        self._queued: Any = None  # the issue order holding it (``order.IssueOrder``), until issued

    # -- the owner's side ------------------------------------------------------------------------
    def settle(self, *, issued: Issued | None = None, error: BaseException | None = None) -> None:
        """The owner's verdict: ``issued`` work to wait for, or the ``error`` ``wait`` raises.
        The first verdict stands (a failure after issue is reported by the work itself)."""
        if self._issued is not None or self._error is not None:
            return
        if error is not None:
            self._error = error
        else:
            self._issued = issued
        self._queued = None

    def complete(self, result: Any) -> None:
        """The owner did the work at once (a one-rank job): ``wait`` returns ``result``."""
        self._result, self._finished = result, True

    def queue(self, order: Any) -> None:
        """Agreed, but issued later by ``order`` (its device's issue order) at a rank-consistent point."""
        if self._issued is None and self._error is None:
            self._queued = order

    def agreed(self) -> bool:
        """True once the owner decided: issued (or already finished), queued for issue, or failed."""
        return (self._issued is not None or self._error is not None or self._queued is not None
                or self._finished)

    @property
    def issued(self) -> bool:
        return self._issued is not None

    @property
    def failed(self) -> bool:
        return self._error is not None

    # -- the caller's side -----------------------------------------------------------------------
    def abandon(self) -> None:
        """The caller will never wait for this request (its step was given up): a CUDA collective's done
        event goes back to the pool once the collective is done, as after a wait; a later ``wait`` raises."""
        if self._finished or self._issued is None:
            return
        self._give_up(self._issued, CollectiveError(f"{_describe(self.request)} was abandoned: its step was given "
                                                    f"up after an error, so its result was never read."))

    def _give_up(self, issued: Issued, error: CollectiveError) -> None:
        """The verdict stands (a later wait raises ``error``) and no wait will be enqueued on ``issued``'s done
        event: it goes back to the pool once its collective is done (a second release is a no-op)."""
        self._error, self._issued = error, None
        if issued.release_done is not None:
            issued.release_done()

    def poll(self) -> bool:
        """True when ``wait`` would return (or raise) without blocking on communication."""
        if self._finished or self._error is not None:
            return True
        order = self._queued
        if order is not None:
            order.issue_for_poll(self)
        issued = self._issued
        if issued is None:
            return self._error is not None
        if issued.covered is not None:
            if not issued.covered.done():
                return False
        elif issued.done_event is not None and not cuda_calls.calls().query(issued.done_event):
            return False
        return all(w.done() for w in issued.works)

    def wait(self) -> Any:
        """The request's result, once it has completed; raises ``CollectiveError`` on failure."""
        if self._finished:
            return self._result
        if not self.agreed():
            self._owner.wait_ready(self, self._owner.timeout)
        order = self._queued
        if order is not None:
            order.issue_for_wait(self)
        if self._error is not None:
            raise self._error
        issued = self._issued
        if issued is None:  # an owner bug: agreed, neither issued nor failed nor queued
            raise CollectiveError(f"internal error: {_describe(self.request)} was agreed but never issued; please "
                                  f"report this as a gpucomm bug.")
        try:
            if issued.works:  # host-completed transfers (Gloo, MPI); a CUDA collective has none
                self._wait_works(issued.works)
            try:
                if issued.covered is not None or issued.done_event is not None:
                    self._result = self._finish_on_stream(issued)
                else:
                    self._result = issued.finalize()
            except Exception as e:  # local work (a stream wait, the result's scaling): no peer to wait for
                raise self._failed(e, 0.0) from e
        except CollectiveError as e:  # a second wait raises it again, and never waits on a done event already
            self._give_up(issued, e)  # handed back (another collective's by then)
            raise
        self._finished = True
        self._issued = None  # drop the backend's references
        return self._result

    def _wait_works(self, works: Sequence[Any]) -> None:
        """Wait for the backend's host works. An owner may follow a wait that blocks: ``blocked_poll`` is
        polled meanwhile instead of ``failure``, and ``wait_ended`` runs after (a fixed schedule tells
        rank 0 of a step that blocks long, see schedule.py)."""
        owner = self._owner
        try:
            blocked = getattr(owner, "blocked_poll", None)
            request = self.request
            poll = (lambda: blocked(request)) if blocked is not None else owner.failure
            for w in works:
                w.wait(owner.timeout, poll)
        except Exception as e:  # the transport failed: a peer's failure may be why
            raise self._failed(e, CAUSE_GRACE if getattr(owner, "has_peers", True) else 0.0, transport=True) from e
        finally:
            ended = getattr(owner, "wait_ended", None)
            if ended is not None:
                ended()

    def _finish_on_stream(self, issued: Issued) -> Any:
        """CUDA: make the caller's stream wait for the collective (nothing when it ran there), then
        produce the result; results made on another stream are marked used on the caller's."""
        request = self.request
        stream = self._waiting_stream()
        if issued.covered is not None:
            issued.covered.wait(stream)
        else:
            if stream != issued.done_stream:
                cuda_calls.calls().wait(stream, issued.done_event, request.index)
            if issued.release_done is not None:
                issued.release_done()
        failure = self._owner.failure()
        if failure is not None:  # the communicators were aborted: what NCCL left in the buffers is no result
            raise failure
        result = issued.finalize()
        if issued.results_on_comm or stream != request.stream:
            _used_on(result, request.index, stream)
        if stream != request.stream:  # waited on from another stream than its submitter's, which never waits
            # for NCCL: its inputs too, or their memory could go to a new tensor there while NCCL reads them
            _used_on((request.send, request.tensors), request.index, stream)
        return result

    def _failed(self, error: Exception, grace: float, transport: bool = False) -> CollectiveError:
        """The error ``wait`` raises: the job's failure as the control plane names it when there is
        one (waiting up to ``grace`` seconds for it to be named: only a transport failure in a job
        with peers may be caused by another rank), else ``error`` as a ``CollectiveError`` (a failed
        ``transport`` with the owner's hint on why peers may be missing)."""
        departure = getattr(self._owner, "departure", None) if transport else None
        request = self.request
        cause = _first_cause(self._owner, grace, (lambda: departure(request)) if departure is not None else None)
        if cause is not None:  # another rank's failure broke this collective: name that first cause
            return CollectiveError(f"{_describe(self.request)} failed because {cause}")
        gone = departure(request) if callable(departure) else None
        if gone is not None:  # a rank it needs shut gpucomm down: that, not the transport's own text
            failed = CollectiveError(f"{_describe(self.request)} failed: {gone}")
            self._owner.departed_failure(failed)  # the owner's work cannot go on (a transfer may stay stuck)
            return failed
        # a transfer that failed with no cause named: what the owner knows of why peers may be missing (also
        # after a backend's own CollectiveError, e.g. MPI's timeout, which cannot know what the collective was)
        hint = getattr(self._owner, "transport_hint", None) if transport else None
        if isinstance(error, CollectiveError):
            if not callable(hint) or isinstance(error, ShutdownError):
                return error
            return CollectiveError(f"{_describe(self.request)} failed: {str(error).rstrip('. ')}{hint()}")
        return CollectiveError(f"{_describe(self.request)} failed: {error}" + (hint() if callable(hint) else ""))

    def _waiting_stream(self) -> int:
        """The raw stream the result must be ready on: the caller's current one. A synchronous op is
        waited on by its submitter right away, so that is the stream it was submitted on (no second
        lookup); an asynchronous one may be waited on from another stream."""
        request = self.request
        if request.waited_at_once:
            return request.stream
        return cuda_calls.calls().current_stream(request.device)


def _used_on(result: Any, index: int, stream: int) -> None:
    """Mark CUDA results as used on the caller's ``stream``. They were allocated on another stream
    (the communication stream, or the stream the op was submitted on), so without this the caching
    allocator could hand their memory to a new allocation on that stream as soon as the caller
    frees them, while kernels the caller queued on its own stream still read them."""
    if isinstance(result, (list, tuple)):
        for item in result:
            _used_on(item, index, stream)
    elif isinstance(result, torch.Tensor) and cuda_calls.is_gpu(result.device):
        cuda_calls.calls().keep_alive(result, index, stream)


def _describe(request: Any) -> str:
    describe = getattr(request, "describe", None)
    return describe() if callable(describe) else repr(request)


def _first_cause(owner: HandleOwner, grace: float, departure: Callable[[], str | None] | None = None
                 ) -> CollectiveError | None:
    """The job's failure as the control plane names it, waiting up to ``grace`` seconds for it: when
    a peer dies, its data connection (a Gloo reset) and its control connection close together, and
    the collective's error can reach the waiter before the control thread has read the closed link.
    The named cause ("the control connection to rank 0 closed: rank 0 exited or failed") says what
    happened; the transport's ("Connection reset by peer") does not. Only a transport failure in a
    job with peers waits (``grace`` > 0), and stops waiting once ``departure()`` names a rank that shut
    gpucomm down (a clean exit is no failure: none would be named); a local error asks once."""
    deadline = time.monotonic() + grace
    while True:
        cause = owner.failure()
        if cause is not None or time.monotonic() >= deadline or (departure is not None and departure() is not None):
            return cause
        time.sleep(0.01)


__all__ = ["Handle", "HandleOwner", "Issued"]
