"""Agreement in a one-rank job: there is nothing to agree on, so collectives run inline.

A data collective goes straight from the caller to the executor (no negotiation, no background
thread, no control round); the first dimensions and splits a multi-rank coordinator would send
are this rank's own. Control operations (barrier, join, process-set changes) go through the same
pure ``Coordinator`` as in a larger job, synchronously, so they keep their checks and errors.
"""

from __future__ import annotations

from typing import Any, Callable

from ..dataplane.handles import Handle, Issued
from ..dataplane.requests import Request
from ..errors import CollectiveError, ShutdownError
from .coordinator import Coordinator
from .negotiation import CONTROL_KINDS, descriptor_of

Execute = Callable[[Request, dict], Issued]


class OneRankPlane:
    """The handle owner of a one-rank job; runs each request on the caller's thread."""

    def __init__(self, execute: Execute, timeout: float, *, on_done: Callable[[str, str, Any], None],
                 process_sets=()) -> None:
        self._execute = execute
        self.timeout = timeout
        self._on_done = on_done
        self._coordinator = Coordinator(1, cache_capacity=0, process_sets=process_sets)
        self._closed = False

    def submit(self, request: Request, **_: Any) -> Handle:
        if self._closed:
            raise ShutdownError(f"{request.describe()} was submitted after gpucomm shut down; call hvd.init() first.")
        if request.kind in CONTROL_KINDS:
            return self._control(request)
        try:
            issued = self._execute(request, _own_meta(request) if request.kind in _META_KINDS else _NO_META)
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits, as in a larger job
            handle = Handle(request, self)
            handle.settle(error=e)
            return handle
        return Handle(request, self, issued)

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


_META_KINDS, _NO_META = ("allgather", "alltoall"), {}


def _own_meta(request: Request) -> dict:
    """The coordinator's additions for one rank: its own first dimensions and splits."""
    if request.kind == "allgather":
        return {"rows": [[t.shape[0] if t.dim() else 1] for t in request.tensors]}
    if request.kind == "alltoall":
        rows = request.tensors[0].shape[0]
        return {"splits": [list(request.splits) if request.splits is not None else [rows]]}
    return {}


__all__ = ["OneRankPlane"]
