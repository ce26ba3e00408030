"""The results of one call on every worker, or the error of its first failure, promptly.

Waiting on every worker's result at once would hang: once one worker dies, the others block in
a collective until gpucomm's own timeouts fire. So the driver waits for whichever finishes first;
after the first failure the others get ``FAILURE_GRACE_S`` to report, and the error names the
failed worker's rank, node and process. A worker that died (its actor is gone) is the cause over
one that raised, and one that raised its own error over one whose collective failed: those are
echoes (a collective that lost its peer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from ..errors import CollectiveError, RunError

FAILURE_GRACE_S = 5.0
POLL_S = 0.2


@dataclass
class Failure:
    index: int  # the worker's rank
    died: bool  # its actor is gone (else its function raised)
    error: BaseException
    at: float


@dataclass
class Gathered:
    """What one call left: ``results`` by rank (None where none came), its ``failures`` in the order
    they arrived, and the ranks still running when the driver gave up waiting (``unfinished``)."""

    results: list[Any]
    failures: list[Failure] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)

    @property
    def cause(self) -> Failure | None:
        """The first worker that died, else the first whose error is its own (a ``CollectiveError``
        is what a rank raises when a peer failed), else the first failure."""
        died = [f for f in self.failures if f.died]
        own = [f for f in self.failures if not isinstance(_raised(f.error), CollectiveError)]
        return (died or own or self.failures or [None])[0]


def _raised(error: BaseException) -> BaseException:
    """The worker's own exception inside Ray's wrapper."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def gather(refs: Sequence[Any], poll: Callable[[], None] | None = None,
           grace: float = FAILURE_GRACE_S) -> Gathered:
    """Wait for ``refs`` (one per rank); see the module's docstring."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    out = Gathered([None] * len(refs))
    deadline = None
    while pending and (deadline is None or time.monotonic() < deadline):
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                out.results[rank] = ray.get(ref)
            except RayTaskError as e:
                out.failures.append(Failure(rank, False, e, time.monotonic()))
            except (RayActorError, RayError) as e:
                out.failures.append(Failure(rank, True, e, time.monotonic()))
        if out.failures and deadline is None:
            deadline = time.monotonic() + grace
        if poll is not None:
            poll()
    out.unfinished = sorted(pending.values())
    return out


def describe(rank: int, size: int, where: Sequence[str]) -> str:
    return f"rank {rank} of {size} ({where[rank]})"


def failure_error(gathered: Gathered, where: Sequence[str], what: str, size: int | None = None) -> RunError:
    """The error of a call that failed: the cause first, then what the other ranks did (``size``:
    the job's ranks, when the call ran on fewer)."""
    cause = gathered.cause
    assert cause is not None
    size = len(gathered.results) if size is None else size
    others = sorted(f.index for f in gathered.failures if f is not cause)
    tail = ""
    if others:
        tail += f" Rank(s) {others} then failed too, most likely as a consequence."
    if gathered.unfinished:
        tail += (f" Rank(s) {gathered.unfinished} had not returned {FAILURE_GRACE_S:g} s later (waiting in a "
                 f"collective for the lost rank); this executor's workers cannot run more calls: call shutdown() and "
                 f"start a new executor.")
    host = where[cause.index]
    if cause.died:
        lines = str(cause.error).strip().splitlines()
        reason = lines[0].rstrip(".") if lines else type(cause.error).__name__
        return RunError(f"gpucomm.ray: {describe(cause.index, size, where)} died before its {what} returned: "
                        f"{reason}. Likely causes: the process was killed (a signal, the out-of-memory killer) or its "
                        f"node was lost; Ray's message above and the worker's output say which.{tail}",
                        rank=cause.index, host=host)
    exc = _raised(cause.error)
    trace = getattr(cause.error, "traceback_str", "") or str(cause.error)
    err = RunError(f"gpucomm.ray: {describe(cause.index, size, where)} raised {type(exc).__name__}: {exc}{tail}\n\n"
                   f"Traceback of rank {cause.index}:\n{trace.rstrip()}", rank=cause.index, host=host,
                   exception=exc, remote_traceback=trace)
    err.__cause__ = exc
    return err


__all__ = ["FAILURE_GRACE_S", "Failure", "Gathered", "failure_error", "gather"]
