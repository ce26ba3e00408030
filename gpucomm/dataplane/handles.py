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
from typing import Any, Callable, Sequence

from ..errors import CollectiveError

CAUSE_GRACE = 2.0  # seconds a broken collective waits for the control plane to name why (a peer's death)


@dataclass
class Issued:
    """What the backend has in flight for one request, and how to turn it into the result."""

    works: Sequence[Any] = ()  # host-completed backend works (Gloo)
    done_event: Any = None  # stream-ordered completion (a CUDA event), or None
    finalize: Callable[[], Any] = lambda: None  # runs once, after completion, on the waiting thread
    results_on_comm: bool = False  # CUDA results allocated on the communication stream
    release_done: Callable[[], None] | None = None  # the waiter has enqueued its wait on ``done_event``


class Handle:
    """One submitted request: ``poll`` never blocks; ``wait`` returns the result or raises.

    A handle is waited on by one thread (``synchronize`` hands it out once)."""

    __slots__ = ("request", "_issued", "_error", "_result", "_finished", "_owner", "_queued")

    def __init__(self, request: Any, owner: Any, issued: Issued | None = None) -> None:
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
        if issued.done_event is not None and not issued.done_event.query():
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
            for w in issued.works:
                w.wait(self._owner.timeout, self._owner.failure)
            if issued.done_event is not None:
                stream = self._waiting_stream()
                stream.wait_event(issued.done_event)
                if issued.release_done is not None:
                    issued.release_done()
                self._result = issued.finalize()
                if issued.results_on_comm or stream is not self.request.stream:
                    _used_on(self._result, stream)
            else:
                self._result = issued.finalize()
        except Exception as e:
            cause = _first_cause(self._owner)
            if cause is not None:  # another rank's failure broke this collective: name that first cause
                raise CollectiveError(f"{_describe(self.request)} failed because {cause}") from e
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"{_describe(self.request)} failed: {e}") from e
        self._finished = True
        self._issued = None  # drop the backend's references
        return self._result

    def _waiting_stream(self) -> Any:
        """The stream the result must be ready on: the caller's current one. A synchronous op is
        waited on by its submitter right away, so that is the stream it was submitted on (no second
        lookup); an asynchronous one may be waited on from another stream."""
        request = self.request
        if request.waited_at_once:
            return request.stream
        import torch  # noqa: PLC0415 - CUDA handles only

        current = torch.cuda.current_stream(request.stream.device)
        return request.stream if current.cuda_stream == request.stream.cuda_stream else current


def _used_on(result: Any, stream: Any) -> None:
    """Mark CUDA results as used on the caller's ``stream``. They were allocated on another stream
    (the communication stream, or the stream the op was submitted on), so without this the caching
    allocator could hand their memory to a new allocation on that stream as soon as the caller
    frees them, while kernels the caller queued on its own stream still read them."""
    if isinstance(result, (list, tuple)):
        for item in result:
            _used_on(item, stream)
    elif getattr(result, "is_cuda", False):
        result.record_stream(stream)


def _describe(request: Any) -> str:
    describe = getattr(request, "describe", None)
    return describe() if callable(describe) else repr(request)


def _first_cause(owner: Any) -> CollectiveError | None:
    """The job's failure as the control plane names it, waiting up to ``CAUSE_GRACE`` for it: when a
    peer dies, its data connection (a Gloo reset) and its control connection close together, and
    the collective's error can reach the waiter before the control thread has read the closed link.
    The named cause ("the control connection to rank 0 closed: rank 0 exited or failed") says what
    happened; the transport's ("Connection reset by peer") does not. Only a failed wait pays this."""
    deadline = time.monotonic() + CAUSE_GRACE
    while True:
        cause = owner.failure()
        if cause is not None or time.monotonic() >= deadline:
            return cause
        time.sleep(0.01)


__all__ = ["Handle", "Issued"]
