"""Ending the control plane, part of ``Controller`` (``controller.py``): a rank's failure reported to
every rank, the job aborted, requests refused after shutdown, rank 0 serving until the others left,
and the connections closed.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from . import channel
from ..errors import ShutdownError


class Shutdown:
    """``Controller``'s shutdown and failure reporting (a base class: it works on the controller's state)."""

    rank: int
    _hub: Any
    _link: Any
    _lock: Any
    _state: Any
    _closed: bool
    _stop_beating: Any
    _bg_wake: threading.Event
    _waker: Any
    _thread: threading.Thread

    def _fail(self, reason: str) -> None:
        raise NotImplementedError

    def _fail_pending(self, error: Callable[[Any], BaseException]) -> None:
        raise NotImplementedError

    def _receive(self, timeout: float) -> None:
        raise NotImplementedError

    def report_failure(self, text: str, *, locked: bool = False) -> None:
        """This rank is failing with ``text``: tell the coordinator first, so every rank names it
        (``locked``: the caller already holds the progress lock)."""
        if not locked:
            with self._lock:
                return self.report_failure(text, locked=True)
        if self._hub is not None:
            self._hub.abort_all(f"rank {self.rank} failed: {text}")
        else:
            if self._link is not None:
                try:
                    channel.send(self._link, [("fail", text)])
                except OSError:
                    pass
            self._fail(f"rank {self.rank} failed: {text}")

    def abort(self, reason: str) -> None:
        """End the job on every rank with ``reason`` as it stands (no "rank N failed:" prefix: the
        reason is the job's, e.g. a second process claiming a rank). Rank 0 tells every rank; another
        rank tells rank 0, which does."""
        with self._lock:
            if self._hub is not None:
                self._hub.abort_all(reason)
            else:
                link = self._link
                if link is not None:
                    try:
                        channel.send(link, [("fail", reason)])
                    except OSError:
                        pass
                self._fail(reason)

    def stop(self, launched: tuple = ()) -> None:
        """Stop taking requests; pending ones fail with ``ShutdownError``. Rank 0 keeps serving the
        coordinator until ``close``. ``launched``: how many collectives of each fixed schedule this rank
        launched (``(set id, number, launches)``), told to the others as it leaves."""
        with self._state:
            if self._closed:
                return
            self._fail_pending(lambda local: ShutdownError(
                f"{local.handle.request.describe()} never ran: gpucomm was shut down while it was pending."))
        if self._link is None:  # rank 0 keeps serving until close; another rank already lost rank 0
            hub = self._hub
            if hub is not None:  # rank 0 submits nothing more: what needs it fails now on every rank, not
                with self._lock:  # after the grace it keeps serving for (rank 0 may not exit for a while)
                    hub.dispatch(hub.coordinator.rank_left(0, "rank 0 has shut gpucomm down"))
                    hub.tell_left(0, launched)
            return
        with self._lock:  # the reader clears ``_link`` (rank 0 went away) under this lock: read it here
            self._closed = True
            link = self._link
            if link is not None:
                try:
                    channel.send(link, [("bye", tuple(launched))])
                except OSError:
                    pass

    def wait_workers_gone(self, grace: float) -> bool:
        """Rank 0: serve the other ranks until each has shut down (or ``grace`` s passed)."""
        if self._hub is None:
            return True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self._lock:
                if self._hub.everyone_left():
                    return True
                self._receive(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._hub.everyone_left()

    def close(self) -> None:
        """Stop the thread and close every connection."""
        self.stop()
        self._closed = True
        if self._stop_beating is not None:
            self._stop_beating.set()
        self._bg_wake.set()
        self._waker.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            if self._hub is not None:
                self._hub.close()
            if self._link is not None:
                try:
                    self._link.sock.close()
                except OSError:
                    pass
        self._waker.close()


__all__ = ["Shutdown"]
