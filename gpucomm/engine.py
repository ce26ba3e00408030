"""Issue order and completion: the queue between the API and the backends.

Every rank must issue its collectives in the same order, so requests are issued one at a time in
submission order. A request that can be issued without waiting on the network is issued on the
caller's thread when nothing is queued ahead of it (no thread hand-off on the hot path); anything
else goes to one background thread, which may block on a metadata exchange without blocking the
caller. A later control plane (name-keyed negotiation, join, process sets) plugs in as the step
that turns a submitted request into an issued one.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .errors import CollectiveError, ShutdownError

log = logging.getLogger("gpucomm.engine")


@dataclass
class Issued:
    """What the backend has in flight for one request, and how to turn it into the result."""

    works: Sequence[Any] = ()  # host-completed backend works (Gloo)
    done_event: Any = None  # stream-ordered completion (a CUDA event), or None
    finalize: Callable[[], Any] = lambda: None  # runs once, after completion, on the waiting thread


class Handle:
    """One submitted request: ``poll`` never blocks; ``wait`` returns the result or raises.

    A handle is waited on by one thread (``synchronize`` hands it out once)."""

    __slots__ = ("request", "_issued", "_error", "_result", "_finished", "_engine")

    def __init__(self, request: Any, engine: "Engine") -> None:
        self.request, self._engine = request, engine
        self._issued: Issued | None = None
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
        timeout = self._engine.timeout
        if not self._ready():
            with self._engine._cv:
                if not self._engine._cv.wait_for(self._ready, timeout):
                    raise CollectiveError(
                        f"{_describe(self.request)} was not issued within {timeout:.0f} s: the operations queued "
                        f"before it are stuck (another rank may be missing from an earlier collective).")
        if self._error is not None:
            raise self._error
        issued = self._issued
        try:
            for w in issued.works:
                w.wait(timeout)
            if issued.done_event is not None:
                import torch  # noqa: PLC0415

                stream = torch.cuda.current_stream(self.request.device)
                stream.wait_event(issued.done_event)
                self._result = issued.finalize()
                _used_on(self._result, stream)
            else:
                self._result = issued.finalize()
        except CollectiveError:
            raise
        except Exception as e:
            raise CollectiveError(f"{_describe(self.request)} failed: {e}") from e
        self._finished = True
        self._issued = None  # drop the backend's references
        return self._result


def _used_on(result: Any, stream: Any) -> None:
    """Mark CUDA results as used on the caller's ``stream``. They were allocated on the
    communication stream, so without this the caching allocator could hand their memory to a new
    communication-stream allocation as soon as the caller frees them, while kernels the caller
    queued on its own stream still read them."""
    if isinstance(result, (list, tuple)):
        for item in result:
            _used_on(item, stream)
    elif getattr(result, "is_cuda", False):
        result.record_stream(stream)


def _describe(request: Any) -> str:
    describe = getattr(request, "describe", None)
    return describe() if callable(describe) else repr(request)


@dataclass
class Engine:
    """Issues requests in submission order, inline when possible, else on the background thread."""

    execute: Callable[[Any], Issued]
    timeout: float
    _queue: collections.deque = field(default_factory=collections.deque)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _busy: bool = False
    _closed: bool = False
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpucomm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Any, *, inline: bool) -> Handle:
        """Queue ``request``; ``inline`` says it can be issued without blocking on the network."""
        handle = Handle(request, self)
        with self._cv:
            if self._closed:
                raise ShutdownError(f"{_describe(request)} was submitted after gpucomm shut down; call hvd.init() first.")
            run_here = inline and not self._busy and not self._queue
            if run_here:
                self._busy = True
            else:
                self._queue.append(handle)
                self._cv.notify_all()
        if run_here:
            try:
                self._issue(handle)
            finally:
                with self._cv:
                    self._busy = False
                    if self._queue:  # wake the thread only when work arrived meanwhile
                        self._cv.notify_all()
        return handle

    def _issue(self, handle: Handle) -> None:
        try:
            handle._issued = self.execute(handle.request)
        except BaseException as e:  # the error belongs to the caller of wait()
            handle._error = e

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._busy or not self._queue):
                    self._cv.wait()
                if self._closed:
                    return
                handle = self._queue.popleft()
                self._busy = True
            try:
                self._issue(handle)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()  # wake threads waiting for this handle to be issued

    def shutdown(self) -> None:
        """Stop issuing; queued requests fail with ``ShutdownError``."""
        with self._cv:
            self._closed = True
            pending, self._queue = list(self._queue), collections.deque()
            self._cv.notify_all()
        with self._cv:
            for h in pending:
                h._error = ShutdownError(f"{_describe(h.request)} never ran: gpucomm was shut down while it was queued.")
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)
