"""Heartbeats on the control channel, so a rank that stopped (SIGSTOP, a frozen host, a hang in a
system call) is named instead of leaving the others waiting for GPUCOMM_TIMEOUT.

Every rank's control thread sends a small ``("hb",)`` frame when it has sent nothing for
``interval`` seconds; rank 0 sends them to every rank. The control thread runs beside the user's
code and the data plane, so a rank that computes for a long time, or waits in a collective, still
beats; only a rank whose process no longer runs falls silent. Rank 0 ends the job when a rank has
been silent for ``timeout`` seconds (naming it and the collective it was in); a rank that hears
nothing from rank 0 for that long fails by itself.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

__all__ = ["Liveness", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 30.0  # s of silence before a rank is declared stopped (GPUCOMM_LIVENESS_TIMEOUT; 0 = off)


class Liveness:
    """When each peer was last heard from, and when we last sent to it."""

    def __init__(self, peers: Iterable[int], timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.interval = min(5.0, timeout / 4)
        self._clock = clock
        now = clock()
        self._heard = {p: now for p in peers}
        self._sent = now

    def heard(self, peer: int) -> None:
        self._heard[peer] = self._clock()

    def sent(self) -> None:
        self._sent = self._clock()

    def beat_due(self) -> bool:
        return self._clock() - self._sent >= self.interval

    def forget(self, peer: int) -> None:
        """``peer`` left on purpose (it shut gpucomm down)."""
        self._heard.pop(peer, None)

    def silent(self) -> list[tuple[int, float]]:
        """Peers silent for longer than ``timeout``, with how long."""
        now = self._clock()
        return [(p, now - t) for p, t in self._heard.items() if now - t > self.timeout]
