"""The stall inspector (rank 0): operations some ranks submitted and others did not, reported by
name with the ranks missing, and turned into an error on every rank after the shutdown time."""

from __future__ import annotations

import logging
import time
from typing import Callable

from .coordinator import Coordinator

log = logging.getLogger("gpucomm.control")

Stalled = list[tuple[int, str, float, list[int]]]  # (set id, name, age in seconds, missing ranks)


class StallInspector:
    """Checks ``coordinator`` at most every ``min(1 s, warning / 4)``; ``report(stalled)`` tells the
    other ranks, ``abort(reason)`` ends the job."""

    def __init__(self, coordinator: Coordinator, warning: float, shutdown: float | None, *,
                 report: Callable[[dict], None], abort: Callable[[str], None]) -> None:
        self._coordinator, self.warning, self.shutdown = coordinator, warning, shutdown
        self._report, self._abort = report, abort
        self._warned: dict[tuple[int, str], float] = {}
        self._steps_warned: dict[int, float] = {}  # rank -> the start of the step wait last warned about
        self._next_check = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + min(1.0, self.warning / 4)
        self._check_steps()
        stalled = self._coordinator.stalled(self.warning)
        if not stalled:
            return
        fresh = [s for s in stalled if now - self._warned.get((s[0], s[1]), -1e18) >= self.warning]
        if fresh:
            for set_id, name, _, _ in fresh:
                self._warned[(set_id, name)] = now
            log.warning("%s", stall_report(stalled, self.warning, self.shutdown))
            self._report({(s, n): missing for s, n, _, missing in stalled})
        if self.shutdown is not None:
            over = [s for s in stalled if s[2] >= self.shutdown]
            if over:
                self._abort(f"the stall inspector stopped the job after {self.shutdown:g} s "
                            f"(GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS). " + stall_report(over, self.warning, None, stopped=True))


    def _check_steps(self) -> None:
        """Warn once per wait about a rank blocked in a DistributedOptimizer step for ``warning`` s: a step
        is never negotiated, so nothing else would say that its peers do not run it."""
        steps = self._coordinator.in_step()
        now = self._coordinator.now()
        for rank in [r for r in self._steps_warned if r not in steps]:
            del self._steps_warned[rank]
        late = {r: (what, since) for r, (what, since) in steps.items()
                if now - since >= self.warning and self._steps_warned.get(r) != since}
        if not late:
            return
        for rank, (_, since) in late.items():
            self._steps_warned[rank] = since
        lines = "\n".join(f"  rank {r}: {what}, waiting {now - since:.0f} s"
                          for r, (what, since) in sorted(late.items()))
        log.warning("Ranks have waited in a DistributedOptimizer step for more than %g s for the other ranks of its "
                    "process set. A step's bucket collectives are never negotiated: every rank of the set must run "
                    "the same step. Likely causes: a rank ran fewer batches or skipped optimizer.step() (call "
                    "hvd.join() there), is stuck outside gpucomm (data loading, a deadlock in the training script), or "
                    "waits in a collective that only some ranks run between backward() and step(); the stall "
                    "warnings of negotiated collectives, if any, name it. The step fails after GPUCOMM_TIMEOUT.\n%s",
                    self.warning, lines)


def stall_report(stalled: Stalled, warning: float, shutdown: float | None, *, stopped: bool = False) -> str:
    """Horovod-style stall warning: which ranks are missing which operations (``stopped``: for the
    error that ends the job, without the warning's advice on what happens next)."""
    by_rank: dict[int, list[str]] = {}
    lines = []
    for set_id, name, age, missing in sorted(stalled, key=lambda s: -s[2]):
        where = "" if set_id == 0 else f" (process set {set_id})"
        lines.append(f"  {name}{where}: waiting {age:.0f} s for ranks {missing}")
        for r in missing:
            by_rank.setdefault(r, []).append(name)
    tail = ("" if stopped else
            f" The job stops with an error after {shutdown:g} s (GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS)."
            if shutdown else " Set GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS to turn a stall into an error.")
    return ("One or more operations were submitted by a subset of ranks and have waited for the remaining ranks "
            f"for more than {warning:g} s. The ranks are not running the same collectives: a rank skipped one or "
            "names it differently, is stuck or much slower, or ran out of data (call hvd.join() there)."
            + tail + "\n" + "\n".join(lines) + "\nMissing ranks:\n"
            + "\n".join(f"  {r}: [{', '.join(names)}]" for r, names in sorted(by_rank.items())))


def negotiation_timeout(what: str, missing: list[int] | None, timeout: float) -> str:
    """The error of a wait that reached GPUCOMM_TIMEOUT before ``what`` was negotiated."""
    who = (f"ranks {missing} have not submitted it" if missing else
           "some ranks have not submitted it (rank 0, which negotiates every collective, knows which: its stall "
           "warning names them), or rank 0 has not answered")
    return (f"{what} was not negotiated within {timeout:.0f} s: {who}. Every rank must run the same collectives "
            f"(same names) in the same order; a rank that ran out of data should call hvd.join(). GPUCOMM_TIMEOUT "
            f"sets this limit.")


__all__ = ["StallInspector", "negotiation_timeout", "stall_report"]
