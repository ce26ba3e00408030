"""One done event per communication stream and step: completion of a fixed schedule's collectives.

A DistributedOptimizer step launches each bucket's collective on its schedule's communication
stream as backward produces the bucket, and ``synchronize()`` waits for all of them in order.
Work on one stream completes in order, so one event recorded after the last launch completes
after every earlier one: waiting for the step needs one done event on the communication stream
and one wait of the caller's stream, whatever the number of buckets. ``StreamCompletion`` records
that event lazily, at the first wait (or poll) that needs it, and covers with it every
collective launched before; a later wait for a collective already covered enqueues nothing (a
stream that has waited once) or one more wait (another stream). A collective launched after the
event was recorded gets a new event when it is waited for.

The step's event is recorded when the step's launches are all issued (``seal``, at the schedule's
``end_step``), so the watchdog watches the step from then on, not only from its first wait. Each
event is handed to the watchdog when recorded, and released to the pool once a newer event has
replaced it (no wait is enqueued on an event after that) or the schedule closes. Waits and
queries on an event are issued under the lock, so no other waiter can release it meanwhile.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from . import cuda_calls
from .events import EventPool

__all__ = ["Covered", "StreamCompletion"]

Watch = Callable[[Any, int, Any, int], Callable[[], None]]  # (event, device, request, stream) -> release


class StreamCompletion:
    """Completion of the collectives launched on raw ``stream`` of GPU ``index`` (see the module doc)."""

    def __init__(self, events: EventPool, watch: Watch, index: int, stream: int) -> None:
        self._events, self._watch = events, watch
        self.index, self.stream = index, stream
        self._launched = 0  # sequence number of the last launch
        self._event: Any = None  # the newest done event
        self._covers = 0  # the launches it covers: 1 .. _covers
        self._waited: set[int] = set()  # streams that waited on it
        self._release: Callable[[], None] | None = None  # hands it back to the watchdog
        self._lock = threading.Lock()  # hooks on autograd threads launch while another thread may wait
        self._last: Any = None

    def launched(self, request: Any) -> "Covered":
        """A collective (``request``) was just launched on the stream: how its waiter completes it."""
        with self._lock:
            self._launched += 1
            self._last = request  # what the watchdog names, and checks departures against
            return Covered(self, self._launched)

    def _cover(self, seq: int) -> Any:
        """(holding the lock) A done event recorded after launch ``seq``: the newest one when it
        covers ``seq``, else a new one covering every launch so far, watched as the newest launch
        (whose step number a departure is checked against: a rank that left after ``seq`` but before
        it is named, not left to the timeout)."""
        if self._event is None or self._covers < seq:
            event = self._events.record(self.stream, self.index)
            release = self._watch(event, self.index, self._last, self.stream)
            if self._release is not None:
                self._release()  # no wait is enqueued on the replaced event from now on
            self._event, self._covers, self._release = event, self._launched, release
            self._waited = set()
        return self._event

    def wait(self, seq: int, stream: int) -> None:
        """Make ``stream`` wait for launch ``seq`` (and, at no extra cost, every launch before it)."""
        with self._lock:  # enqueued under the lock: another waiter may replace (and release) the event
            event = self._cover(seq)
            if stream not in self._waited:
                self._waited.add(stream)
                cuda_calls.calls().wait(stream, event, self.index)

    def done(self, seq: int) -> bool:
        """True once launch ``seq`` has completed (records its covering event if none yet)."""
        with self._lock:
            return cuda_calls.calls().query(self._cover(seq))

    def seal(self) -> None:
        """The step's launches are all issued: cover them now, so that the watchdog watches the step
        from here (not only from the first wait), with the event its waits will use."""
        with self._lock:
            if self._launched > self._covers:
                self._cover(self._launched)

    def close(self) -> None:
        """The schedule ends: the last event goes back to the watchdog's retirement."""
        with self._lock:
            release, self._release = self._release, None
            self._event = None
        if release is not None:
            release()


class Covered:
    """One launch's completion: ``wait(stream)`` makes ``stream`` wait for it, ``done()`` asks."""

    __slots__ = ("_completion", "seq")

    def __init__(self, completion: StreamCompletion, seq: int) -> None:
        self._completion, self.seq = completion, seq

    def wait(self, stream: int) -> None:
        self._completion.wait(self.seq, stream)

    def done(self) -> bool:
        return self._completion.done(self.seq)
