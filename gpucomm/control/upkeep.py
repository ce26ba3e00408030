"""The control plane's time-based upkeep, part of ``Controller`` (``controller.py``): heartbeats
between rank 0 and the others, the silence check on rank 0, telling rank 0 which operations callers
are blocked on (deadlock detection), and rank 0's liveness, clash and stall checks.
"""

from __future__ import annotations

import time
from typing import Any

from . import channel

HOUSEKEEPING_S = 0.05  # s between the time-based checks (each limit they apply is >= 0.5 s)
BLOCKED_NOTE_AFTER = 0.5  # s a caller waits on an unfinished negotiation before rank 0 hears of it


class Upkeep:
    """``Controller``'s time-based checks (a base class: it works on the controller's own state)."""

    _hub: Any
    _link: Any
    _liveness: Any
    _standins: Any
    _failure: Any
    _state: Any
    _inflight: dict
    _blocked_since: dict
    _blocked_told: set
    _in_step: str | None
    _in_step_told: str | None
    _next_housekeeping: float
    _root_host: str
    coordinator_lost: bool

    def _fail(self, reason: str) -> None:
        raise NotImplementedError

    def _stall_tick(self) -> float:
        tick = 0.25 if self._hub is not None else 1.0
        if self._liveness is not None:
            tick = min(tick, self._liveness.interval / 2)  # beats go out on time
        return tick

    def _housekeeping(self) -> None:
        """Time-based checks (heartbeat silence, blocked callers, stalls, clashes, deadlocks, joined
        stand-ins): every limit they apply is half a second or more, so at most every
        ``HOUSEKEEPING_S``, not on every frame."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_S
        self._standins.prune()
        if self._liveness is not None and self._failure is None:
            self._beat_to_root()
        if self._blocked_since and self._failure is None:
            self._tell_blocked()
        if self._in_step != self._in_step_told and self._failure is None:
            self._tell_in_step()
        if self._hub is not None and self._failure is None:
            self._hub.check_liveness()
            self._hub.check_clashes()
            if self._hub.stalls is not None:
                self._hub.stalls.check()  # once the job has failed, a stall is no news: say nothing more

    def _tell_blocked(self) -> None:
        """Tell rank 0 which operations a caller has been blocked on for a while, so it can see a
        deadlock (every member blocked on an operation that lacks another member)."""
        now = time.monotonic()
        with self._state:
            due = [k for k, t in self._blocked_since.items() if now - t >= BLOCKED_NOTE_AFTER
                   and k not in self._blocked_told and k in self._inflight]
            self._blocked_told.update(due)
        for set_id, name in due:
            if self._hub is not None:
                self._hub.coordinator.note_blocked(0, (set_id, name))
            elif self._link is not None:
                try:
                    channel.send(self._link, [("blocked", set_id, name)])
                except OSError:
                    pass  # the receive side reports the broken connection

    def _tell_in_step(self) -> None:
        """Tell rank 0 that this rank's caller blocks in a DistributedOptimizer step, or no longer."""
        with self._state:
            what = self._in_step
        self._in_step_told = what
        if self._hub is not None:
            self._hub.coordinator.note_in_step(0, what)
        elif self._link is not None:
            try:
                channel.send(self._link, [("in_step", what)])
            except OSError:
                pass  # the receive side reports the broken connection

    def _beat(self) -> None:
        """One heartbeat (the beating thread: no control lock needed; channels serialise sends)."""
        link = self._link  # read once: the reader may clear it meanwhile
        if self._hub is not None:
            self._hub.beat()
        elif link is not None:
            channel.send(link, [("hb",)])

    def _beat_to_root(self) -> None:
        """Other ranks: fail if rank 0 has fallen silent."""
        for _, seconds in self._liveness.silent():
            self.coordinator_lost = True
            self._fail(f"rank 0 (the coordinator) stopped responding: nothing heard from rank 0{self._root_host} for "
                       f"{seconds:.0f} s. Likely causes: rank 0 was stopped (SIGSTOP, a debugger), its host froze or "
                       f"lost the network (a cut link, a partition). GPUCOMM_LIVENESS_TIMEOUT sets this limit (0 turns "
                       f"the check off).")


__all__ = ["BLOCKED_NOTE_AFTER", "HOUSEKEEPING_S", "Upkeep"]
