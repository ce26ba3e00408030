"""A fixed schedule: one DistributedOptimizer's bucket allreduces, launched strictly in bucket
order on every rank, with no control-plane message.

Agreement happens once, when the optimizer verifies its parameters and buckets across ranks; from
then on every rank issues the same collectives in the same order by construction. The schedule
runs on a group of its own (its own Gloo process group, or NCCL communicator and stream), so the
order of its collectives never interleaves with negotiated ad-hoc collectives, whose order the
coordinator decides at run time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import CollectiveError
from .events import EventPool
from .executor import Executor, prepare
from .groups import Group
from .handles import Handle
from .requests import Request


class Schedule:
    """Launches requests on ``group`` in the order given; the caller keeps that order the same on
    every rank. ``watch(done_event, request)`` hands CUDA work to the NCCL watchdog; ``failure()``
    names the job's first failure, if any."""

    def __init__(self, group: Group, *, timeout: float, events: EventPool,
                 tracer: Callable[[], Any] = lambda: None,
                 watch: Callable[[Any, Request], None] | None = None,
                 failure: Callable[[], CollectiveError | None] = lambda: None) -> None:
        self.group = group
        self.timeout = timeout
        self._events = events
        self._executor = Executor(lambda set_id: group, tracer, events=events)
        self._watch = watch
        self._failure = failure

    def open(self, device: torch.device) -> None:
        """Build the group's backend for ``device`` now (a collective call: every member builds it
        at the same point), so the first step does not pay for it inside backward."""
        if device.type == "cuda":
            self.group.nccl()
        else:
            self.group.gloo()

    def launch(self, request: Request) -> Handle:
        """Issue ``request`` now, on the caller's thread."""
        if request.device.type == "cuda":
            request.stream = torch.cuda.current_stream(request.device)
            prepare(request)  # before the ready event: the communication stream must see its work
            request.ready_event = self._events.record(request.stream)
        else:
            prepare(request)
        issued = self._executor(request, {})
        if self._watch is not None and issued.done_event is not None:
            self._watch(issued.done_event, request)
        return Handle(request, self, issued)

    # -- the handle owner's side ---------------------------------------------------------------
    def wait_ready(self, handle: Handle, timeout: float) -> None:
        raise CollectiveError(f"internal error: {handle.request.describe()} was never issued on its fixed "
                              f"schedule; please report this as a gpucomm bug.")

    def failure(self) -> CollectiveError | None:
        return self._failure()

    def close(self, *, abort: bool = False) -> None:
        """Release the schedule's communicators (``abort``: the job failed, do not wait for transfers)."""
        self.group.close(abort=abort)


__all__ = ["Schedule"]
