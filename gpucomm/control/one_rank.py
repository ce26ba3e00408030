"""Agreement in a one-rank job: there is nothing to agree on, so collectives run on the caller's
thread. ("Inline" in gpucomm means something else: a small CPU collective riding the control round,
``gpucomm.dataplane.inline``.)

A data collective is computed on the caller's thread where its data lies (``dataplane.local``: no
negotiation, no background thread, no backend, no NCCL: a copy, or nothing in place). Control
operations (barrier, join, process-set changes) go through the same pure ``Coordinator`` as in a
larger job, synchronously, so they keep their checks and errors.
"""

from __future__ import annotations

from typing import Any, Callable

from ..dataplane.handles import Handle, Issued
from ..dataplane.local import local_result
from ..dataplane.requests import Request
from ..errors import CollectiveError, ShutdownError
from .coordinator import Coordinator
from .negotiation import CONTROL_KINDS, descriptor_of


class OneRankPlane:
    """The handle owner of a one-rank job; runs each request on the caller's thread."""

    has_peers = False  # no other rank's failure can be why a collective failed

    def __init__(self, timeout: float, *, on_done: Callable[[str, str, Any], None], process_sets=()) -> None:
        self.timeout = timeout
        self._on_done = on_done
        self._coordinator = Coordinator(1, cache_capacity=0, process_sets=process_sets)
        self._closed = False

    def submit(self, request: Request, **_: Any) -> Handle:
        if self._closed:
            raise ShutdownError(f"{request.describe()} was submitted after gpucomm shut down; call hvd.init() first.")
        if request.kind in CONTROL_KINDS:
            return self._control(request)
        handle = Handle(request, self)
        try:
            handle.complete(local_result(request))
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits, as in a larger job
            handle.settle(error=e)
        return handle

    def run_now(self, request: Request) -> Any:
        """A data collective's result at once (the synchronous forms): one rank's own data, scaled."""
        if self._closed:
            raise ShutdownError(f"{request.describe()} was submitted after gpucomm shut down; call hvd.init() first.")
        return local_result(request)

    def _control(self, request: Request) -> Handle:
        key_set, name = request.set_id, request.name
        handle = Handle(request, self)
        for _, response in self._coordinator.submit(0, [("req", key_set, name, descriptor_of(request), None)]):
            if response[0] == "error":
                handle.settle(error=CollectiveError(response[3]))
            elif response[0] == "done":
                self._on_done(request.kind, name, response[3])
                handle.settle(issued=Issued(finalize=lambda v=response[3]: v))
        if not handle.agreed():
            handle.settle(error=CollectiveError(f"internal error: {request.describe()} got no answer in a one-rank "
                                                f"job; please report this as a gpucomm bug."))
        return handle

    def wait_ready(self, handle: Handle, timeout: float) -> None:
        raise CollectiveError(f"internal error: {handle.request.describe()} was never issued in a one-rank job; "
                              f"please report this as a gpucomm bug.")

    def failure(self) -> CollectiveError | None:
        return None

    def close(self) -> None:
        self._closed = True


__all__ = ["OneRankPlane"]
