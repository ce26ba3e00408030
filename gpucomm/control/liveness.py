"""Heartbeats on the control channel, so a rank that stopped (SIGSTOP, a frozen host, a hang in a
system call) is named instead of leaving the others waiting for GPUCOMM_TIMEOUT.

A small thread of its own in every rank sends a ``("hb",)`` frame every ``interval`` seconds (rank
0 to every rank), needing none of the control plane's locks: a rank that computes for a long time,
waits in a collective, or holds the control lock while it creates a communicator still beats; only
a rank whose process no longer runs falls silent. A side that itself did not look for a while (its
control thread was busy) forgets what it missed rather than blaming peers for it. Rank 0 ends the job when a rank has
been silent for ``timeout`` seconds (naming it and the collective it was in); a rank that hears
nothing from rank 0 for that long fails by itself.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from ..settings import DEFAULT_LIVENESS_S

__all__ = ["Liveness", "DEFAULT_TIMEOUT", "start_beating"]

DEFAULT_TIMEOUT = DEFAULT_LIVENESS_S  # s of silence before a rank is declared stopped (GPUCOMM_LIVENESS_TIMEOUT; 0 = off)


class Liveness:
    """When each peer was last heard from."""

    def __init__(self, peers: Iterable[int], timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.interval = min(5.0, timeout / 4)
        self._clock = clock
        now = clock()
        self._heard = {p: now for p in peers}
        self._checked = now

    def heard(self, peer: int) -> None:
        self._heard[peer] = self._clock()

    def forget(self, peer: int) -> None:
        """``peer`` left on purpose (it shut gpucomm down)."""
        self._heard.pop(peer, None)

    def silent(self) -> list[tuple[int, float]]:
        """Peers silent for longer than ``timeout``, with how long. If this side has not checked for
        two intervals (its frames were not read meanwhile), the clock restarts for every peer."""
        now = self._clock()
        if now - self._checked > 2 * self.interval:
            self._heard = dict.fromkeys(self._heard, now)
        self._checked = now
        return [(p, now - t) for p, t in self._heard.items() if now - t > self.timeout]

    def quiet_for(self, seconds: float) -> list[tuple[int, float]]:
        """Peers not heard from for more than ``seconds`` (below the timeout too), with how long."""
        now = self._clock()
        return [(p, now - t) for p, t in self._heard.items() if now - t > seconds]


def start_beating(interval: float, send: Callable[[], None], name: str) -> "threading.Event":
    """A daemon thread that calls ``send()`` every ``interval`` seconds until the returned event is set."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                send()
            except Exception:  # noqa: BLE001 - a broken connection is reported by the receiving side
                pass

    threading.Thread(target=beat, name=name, daemon=True).start()
    return stop
