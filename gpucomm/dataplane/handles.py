"""Handles: what a submitted collective gives its caller, from submission to result.

A handle becomes *issued* when its request has been handed to a backend (at once in a one-rank job
or on a fixed schedule, after negotiation otherwise); ``wait`` then waits for the backend's work and
produces the result. Its *owner* (the control plane, or the one-rank plane) drives a handle that is
not issued yet and knows why the job failed, if it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import CollectiveError


@dataclass
class Issued:
    """What the backend has in flight for one request, and how to turn it into the result."""

    works: Sequence[Any] = ()  # host-completed backend works (Gloo)
    done_event: Any = None  # stream-ordered completion (a CUDA event), or None
    finalize: Callable[[], Any] = lambda: None  # runs once, after completion, on the waiting thread
    results_on_comm: bool = False  # CUDA results allocated on the communication stream
    release_done: Callable[[], None] | None = None  # recycles the done event once the caller waits on it


class Handle:
    """One submitted request: ``poll`` never blocks; ``wait`` returns the result or raises.

    A handle is waited on by one thread (``synchronize`` hands it out once)."""

    __slots__ = ("request", "_issued", "_error", "_result", "_finished", "_owner")

    def __init__(self, request: Any, owner: Any, issued: Issued | None = None) -> None:
        self.request, self._owner = request, owner
        self._issued: Issued | None = issued
        self._error: BaseException | None = None
        self._result: Any = None
        self._finished = False

    def _ready(self) -> bool:
        return self._issued is not None or self._error is not None

    def poll(self) -> bool:
        """True when ``wait`` would return (or raise) without blocking on communication."""
        if self._finished or self._error is not None:
            return True
        issued = self._issued
        if issued is None:
            return False
        if issued.done_event is not None and not issued.done_event.query():
            return False
        return all(w.done() for w in issued.works)

    def wait(self) -> Any:
        """The request's result, once it has completed; raises ``CollectiveError`` on failure."""
        if self._finished:
            return self._result
        if self._issued is None and self._error is None:
            self._owner.wait_ready(self, self._owner.timeout)
        if self._error is not None:
            raise self._error
        issued = self._issued
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
            cause = self._owner.failure()
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
