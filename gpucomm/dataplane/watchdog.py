"""The NCCL watchdog: CUDA collectives in flight are checked for NCCL's asynchronous errors and for
finishing within the timeout; either failure aborts the communicator (so no stream waits forever
on a peer that will never arrive) and is reported as the job's failure."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from ..backends.nccl import NCCL_HINT


class NcclWatchdog:
    """``health(set_id, abort)`` returns NCCL's asynchronous error for a process set's
    communicators (or aborts them); ``fail(text)`` reports the failure."""

    def __init__(self, rank: int, timeout: float, health: Callable[[int, bool], str | None],
                 fail: Callable[[str], None]) -> None:
        self.rank, self.timeout = rank, timeout
        self._health, self._fail = health, fail
        self._inflight: collections.deque = collections.deque()  # (issued at, done event, request)
        self._lock = threading.Lock()

    def watch(self, done_event: Any, request: Any) -> None:
        with self._lock:
            self._inflight.append((time.monotonic(), done_event, request))

    def __bool__(self) -> bool:
        return bool(self._inflight)

    def check(self) -> None:
        """Retire finished collectives; report the oldest unfinished one if NCCL failed or it is overdue."""
        with self._lock:
            inflight = self._inflight
            while inflight and inflight[0][1].query():
                inflight.popleft()
            if not inflight:
                return
            started, _, request = inflight[0]
        error = self._health(request.set_id, False)
        if error is None and time.monotonic() - started <= self.timeout:
            return
        self._health(request.set_id, True)  # abort
        if error is not None:
            why = f"NCCL reported an error while {request.describe()} was in flight on rank {self.rank}: {error}"
        else:
            who = "every rank" if request.set_id == 0 else f"the members of process set {request.set_id}"
            why = (f"{request.describe()} did not finish within {self.timeout:.0f} s (GPUCOMM_TIMEOUT) on rank "
                   f"{self.rank}: at least one of the ranks it needs ({who}) never reached it — that rank died, "
                   f"hangs before this collective, or cannot reach this one")
        with self._lock:
            self._inflight.clear()
        self._fail(why + ". The NCCL communicator was aborted. " + NCCL_HINT)


__all__ = ["NcclWatchdog"]
