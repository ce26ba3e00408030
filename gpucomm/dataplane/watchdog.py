"""The NCCL watchdog and the retirement of done events, on a thread of the data plane.

Every CUDA collective issued anywhere in the job (negotiated, on a fixed schedule, a join stand-in)
is watched from issue until a done event recorded after it has completed: NCCL's asynchronous
errors and a collective overdue by the timeout are reported as the job's failure (the data plane
then aborts its communicators, so no stream waits forever on a peer that will never arrive).

Work on one stream completes in order, so the watched events are kept in one queue per stream
and each queue is retired from its head: a finished collective on one stream is never held back
by an unfinished one on another. A query that fails (CUDA reports the error of an earlier
kernel) is the job's failure too, reported once; the collective being watched stays watched.

A collective can also stop the host before it is watched: since NCCL 2.22 the first collective that
needs a connection to a peer makes it inside the host call, which returns only once that peer
reaches the same collective. The executor notes each CUDA collective's host call in ``host_calls``
while it runs; one that has not returned within the timeout is the job's failure as well (the abort
then makes it return), whatever locks the stuck thread holds.

Done events come from the job's ``EventPool`` and go back to it once two things happened: the GPU
finished the collective (seen here), and its waiter enqueued its wait on the event (the handle
calls ``release``). Either may come first; only both make reuse safe, since this thread still
queries an event that a waiter has already waited on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from ..backends.nccl import NCCL_HINT
from . import cuda_calls
from .events import EventPool

log = logging.getLogger("gpucomm.nccl")

TICK = 0.1  # seconds between checks


class _InFlight:
    __slots__ = ("started", "event", "device", "request", "waited", "finished", "retired", "watchdog")

    def __init__(self, watchdog: "NcclWatchdog", event: Any, device: int, request: Any) -> None:
        self.watchdog, self.event, self.device, self.request = watchdog, event, device, request
        self.started = time.monotonic()
        self.waited = self.finished = self.retired = False

    def release(self) -> None:
        """The waiter enqueued its wait on the event."""
        self.watchdog._waited(self)


class NcclWatchdog:
    """``health(set_id)`` returns NCCL's asynchronous error on a process set's communicators (or
    None); ``departed(request)`` says which members of a fixed schedule step's set shut gpucomm down
    before launching that step (or None): such a collective can never finish and fails at once, not at
    the timeout (NCCL would wait for them for ever); ``fail(text)`` reports the failure (the caller
    aborts); ``select_device()`` runs first on the watchdog's thread, which starts with the first
    watched collective."""

    def __init__(self, rank: int, timeout: float, events: EventPool, *, health: Callable[[int], str | None],
                 fail: Callable[[str], None], select_device: Callable[[], None] = lambda: None,
                 departed: Callable[[Any], str | None] = lambda request: None) -> None:
        self.rank, self.timeout = rank, timeout
        self._events = events
        self._health, self._fail, self._select_device = health, fail, select_device
        self._departed = departed
        self._queues: dict[tuple[int, int], collections.deque] = {}  # (device, stream) -> entries in issue order
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._query_error: str | None = None  # a failed query, to report outside the lock
        self._reported = False  # the job's failure was reported (once)
        self.failed = False  # a failure was found (then nothing counts as drained)
        self.failure: str | None = None  # what it was, for a shutdown that finds the work undrained
        self.retired = 0  # done events returned to the pool
        # thread id -> (request, monotonic start) of each CUDA collective's host call running now (the
        # executor writes it with C-level dict calls only; read here as a snapshot)
        self.host_calls: dict[int, tuple[Any, float]] = {}
        events.reclaim = self.reclaim

    def watch(self, done_event: Any, device: int, request: Any, stream: int = 0) -> Callable[[], None]:
        """Watch a collective whose completion is ``done_event`` (recorded on raw ``stream`` of GPU
        ``device``); returns what its waiter calls once it has enqueued its wait."""
        entry = _InFlight(self, done_event, device, request)
        with self._lock:
            queue = self._queues.get((device, stream))
            if queue is None:
                queue = self._queues[(device, stream)] = collections.deque()
            queue.append(entry)  # no query here: the pool reclaims before it makes an event, the thread ticks
            self._start()
        return entry.release

    def start(self) -> None:
        """Run the watchdog's thread from now (the first CUDA collective's host call: it may block
        before anything is watched)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        """(holding the lock) The thread, started once."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="gpucomm-nccl-watchdog", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def reclaim(self) -> None:
        """Return the events of the collectives finished so far to the pool (the pool asks before it
        makes a new event). A failed query found here is reported by the watchdog's thread at its
        next tick, not on the caller's (a hook inside backward, a thread holding a completion's or
        an issue order's lock): failing the job aborts every communicator and settles queued work."""
        with self._lock:
            self._retire_finished()

    def _waited(self, entry: _InFlight) -> None:
        with self._lock:
            entry.waited = True
            if entry.finished:
                self._retire(entry)

    def _retire(self, entry: _InFlight) -> None:
        """(holding the lock) Return the event to the pool, once."""
        if not entry.retired:
            entry.retired = True
            self._events.release(entry.event, entry.device)
            self.retired += 1

    def _retire_finished(self) -> bool:
        """(holding the lock) Retire each stream's finished collectives, from the head of its queue;
        True if none is left. A query that raises is kept in ``_query_error`` for the caller to
        report after letting go of the lock."""
        query = cuda_calls.calls().query
        for key in list(self._queues):
            queue = self._queues[key]
            while queue:
                entry = queue[0]
                try:
                    done = query(entry.event)
                except Exception as e:  # noqa: BLE001 - CUDA's error: the job's failure, reported once
                    text = (f"CUDA reported an error while {entry.request.describe()} was in flight on rank "
                            f"{self.rank} (GPU {entry.device}): {e}")
                    if self._query_error is None and not self._reported:
                        self._query_error = text
                    self.failed = True  # nothing counts as drained from now on
                    self.failure = self.failure or text
                    return False
                if not done:
                    break
                queue.popleft()
                entry.finished = True
                if entry.waited:
                    self._retire(entry)
            if not queue:
                del self._queues[key]
        return not self._queues

    def _report_query_error(self) -> None:
        """Report a failed query as the job's failure (once), after the lock is let go."""
        with self._lock:
            text, self._query_error = self._query_error, None
            if text is None or self._reported:
                return
            self._reported = self.failed = True  # nothing counts as drained from now on
        self._stop.set()
        self._fail(text + ". The NCCL communicators were aborted. " + NCCL_HINT)

    def _oldest(self) -> _InFlight | None:
        """(holding the lock) The unfinished collective issued first, over every stream."""
        heads = [q[0] for q in self._queues.values() if q]
        return min(heads, key=lambda e: e.started) if heads else None

    def check(self) -> None:
        """Retire finished collectives; report the oldest unfinished one if NCCL failed or it is overdue,
        a stream's first unfinished one that a member of its set can no longer run (it shut gpucomm down
        before launching that step), and a host call that has not returned within the timeout."""
        with self._lock:
            empty = self._retire_finished()
            oldest = None if empty else self._oldest()
            heads = [] if empty else [q[0] for q in self._queues.values() if q]
        self._report_query_error()
        if self.failed or self._reported:
            return
        if self.host_calls and self._check_host_calls():
            return
        if oldest is None:
            return
        gone = None
        for head in heads:  # (cheap while no rank left: the callback answers from an empty dict)
            gone = self._departed(head.request)
            if gone is not None and not self._finished_since(head):
                oldest = head
                break
            gone = None
        error = self._health(oldest.request.set_id) if gone is None else None
        if error is None and gone is None and (time.monotonic() - oldest.started <= self.timeout
                                               or self._finished_since(oldest)):
            return  # in time, or it finished meanwhile
        request = oldest.request
        if error is not None:
            why = f"NCCL reported an error while {request.describe()} was in flight on rank {self.rank}: {error}"
        elif gone is not None:
            why = f"{request.describe()} cannot finish on rank {self.rank}: {gone}"
        else:
            who = "every rank" if request.set_id == 0 else f"the members of process set {request.set_id}"
            why = (f"{request.describe()} did not finish within {self.timeout:.0f} s (GPUCOMM_TIMEOUT) on rank "
                   f"{self.rank}: at least one of the ranks it needs ({who}) never reached it — that rank died, "
                   f"hangs before this collective, or cannot reach this one")
        self._report_failure(why)

    def _report_failure(self, why: str) -> bool:
        """Report ``why`` as the job's failure, once (False: already reported); the caller aborts."""
        with self._lock:
            if self._reported:
                return False
            self.failed = self._reported = True  # before clearing: a drain after this never reports "all finished"
            self.failure = self.failure or why
            self._queues.clear()
        self._stop.set()
        self._fail(why + ". The NCCL communicators were aborted. " + NCCL_HINT)
        return True

    def _check_host_calls(self) -> bool:
        """Report the oldest CUDA collective whose host call has not returned within the timeout (True
        if one was reported)."""
        running = list(self.host_calls.values())  # a snapshot: other threads add and remove entries
        if not running:
            return False
        request, started = min(running, key=lambda entry: entry[1])
        waited = time.monotonic() - started
        if waited <= self.timeout:
            return False
        if getattr(request, "creating", False):
            why = (f"{request.describe()} has not finished on rank {self.rank} after {waited:.0f} s (GPUCOMM_TIMEOUT "
                   f"is {self.timeout:.0f} s): NCCL creates a communicator only once every member joins. Likely "
                   f"causes: a rank died or hangs before this collective, or the network between the ranks is cut; "
                   f"the other ranks' logs name the first failure. A communicator still being created cannot be "
                   f"aborted: this rank's caller stays blocked, and the other ranks fail with this error")
        else:
            why = (f"the host call that issues {request.describe()} on rank {self.rank} has not returned for "
                   f"{waited:.0f} s (GPUCOMM_TIMEOUT is {self.timeout:.0f} s). NCCL (since 2.22) connects a "
                   f"communicator's peers inside the first collective that needs them, and that call returns only "
                   f"once the peers reach the same collective. Likely causes: a rank died or hangs before this "
                   f"collective, or the network between the ranks is cut; the other ranks' logs name the first "
                   f"failure. Setting NCCL_RUNTIME_CONNECT=0 makes NCCL connect every peer when the communicator is "
                   f"created instead")
        self._report_failure(why)
        return True

    def _finished_since(self, entry: _InFlight) -> bool:
        """``entry`` finished after ``check`` let go of the lock: retired meanwhile (by ``reclaim`` or
        ``watch`` on another thread, whose event may already be recorded anew, so its query would
        say False) or its event says so now."""
        with self._lock:
            if entry.finished:
                return True
            try:
                return cuda_calls.calls().query(entry.event)
            except Exception:  # noqa: BLE001 - reported by the next retirement
                return False

    def drain(self, grace: float) -> bool:
        """Wait up to ``grace`` seconds for every watched collective to finish; True if they did."""
        deadline = time.monotonic() + grace
        while True:
            with self._lock:
                done = not self.failed and self._retire_finished()
                failed = self.failed or self._query_error is not None
            self._report_query_error()
            if failed:
                return False
            if done:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Stop watching (the job is ending)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._lock:
            self._queues.clear()

    def _run(self) -> None:
        try:
            self._select_device()
            while not self._stop.wait(TICK):
                self.check()
        except Exception as e:  # never die silently: a collective that hangs would then never be reported
            log.exception("gpucomm NCCL watchdog failed")
            self._fail(f"the gpucomm NCCL watchdog failed on rank {self.rank} ({type(e).__name__}: {e}); this is a "
                       f"gpucomm bug")


__all__ = ["NcclWatchdog"]
