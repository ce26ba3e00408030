"""Pooled CUDA events (timing off): recording an event costs a lookup in a list instead of a new
CUDA event per collective.

An event may go back to the pool as soon as every wait on it has been *enqueued*: CUDA captures
the event's state when ``cudaStreamWaitEvent`` is called, so recording it again later does not
disturb a wait already queued. Events are raw handles made and recorded through
``cuda_calls`` (counted there).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..counters import COUNTERS
from . import cuda_calls


class EventPool:
    """Free events per device; ``record`` takes one (or makes one) and records it on ``stream``.

    ``reclaim()`` (set by the watchdog, which owns done events in flight) returns the events of
    collectives that finished since it last looked; ``record`` calls it before making a new event,
    so a step never makes one while a finished collective's event waits for the watchdog's tick."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._made: list[int] = []  # every event made, destroyed at ``close``
        self._lock = threading.Lock()  # hooks on different autograd threads may record at once
        self.reclaim: Callable[[], None] = lambda: None

    def _take(self, device_index: int) -> Any:
        with self._lock:
            free = self._free.get(device_index)
            return free.pop() if free else None

    def record(self, stream: int, device_index: int) -> int:
        """A pooled event recorded on raw stream ``stream`` of GPU ``device_index``."""
        with self._lock:
            free = self._free.get(device_index)
            event = free.pop() if free else None
        if event is None:
            self.reclaim()
            event = self._take(device_index)
        calls = cuda_calls.calls()
        if event is None:
            event = calls.new_event(device_index)
            COUNTERS.cuda_events_created += 1
            with self._lock:
                self._made.append(event)
        calls.record(event, stream, device_index)
        return event

    def release(self, event: Any, device_index: int) -> None:
        """Return ``event``; the caller has enqueued every wait on it."""
        with self._lock:
            self._free.setdefault(device_index, []).append(event)

    def close(self) -> None:
        """Destroy every event made (the job is ending; nothing waits on them any more)."""
        with self._lock:
            made, self._made, self._free = self._made, [], {}
        calls = cuda_calls.calls()
        for event in made:
            try:
                calls.destroy_event(event)
            except Exception:  # noqa: BLE001 - a failed job's context may be gone: nothing to free then
                pass

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())


__all__ = ["EventPool"]
