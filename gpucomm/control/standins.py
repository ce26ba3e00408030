"""A joined rank's part in the collectives the others still run: zeros of the right shape and
dtype, described by the template the coordinator sends with the response (Horovod's join)."""

from __future__ import annotations

from typing import Callable

import torch

from ..dataplane import cuda_calls
from ..dataplane.events import EventPool
from ..dataplane.executor import prepare
from ..dataplane.handles import Issued
from ..dataplane.requests import Request
from .negotiation import Descriptor


class StandIns:
    """``run(request, meta, keep)`` issues a collective nobody waits on (in its device's issue
    order) and hands what was issued to ``keep``; ``zeros_device()`` is where CUDA zeros go;
    ``events`` gives the ready events (the executor returns them to it)."""

    def __init__(self, run: Callable[[Request, dict, Callable[[Issued], None]], None],
                 zeros_device: Callable[[], torch.device], events: EventPool) -> None:
        self._run, self._zeros_device, self._events = run, zeros_device, events
        self.joining = False
        self._issued: list[Issued] = []

    def run(self, set_id: int, name: str, meta: dict) -> None:
        """Take part in ``name``'s collective with zeros (the template in ``meta`` describes it)."""
        template: Descriptor = meta["template"]
        device = torch.device("cpu") if template.device == "cpu" else self._zeros_device()
        tensors = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                   for dtype, shape in zip(template.dtypes, template.shapes)]
        request = Request(template.kind, name, tensors, outputs=tensors, op=template.op, prescale=template.prescale,
                          postscale=template.postscale, root=template.root, splits=template.splits, device=device,
                          set_id=set_id)
        gpu = cuda_calls.is_gpu(device)
        if gpu:
            calls = cuda_calls.calls()
            request.index = calls.index(device)
            request.stream = calls.current_stream(device)
        if request.kind in ("allreduce", "broadcast"):
            prepare(request)
        if gpu:
            request.ready_event = self._events.record(request.stream, request.index)
        self._run(request, meta, self._issued.append)

    def prune(self) -> None:
        """Forget the stand-ins that have finished: their zeros (held by ``finalize``) stay alive
        until then, so no new allocation reuses their memory while NCCL still reads or writes it.
        A finished CUDA stand-in's done event goes back to the pool (nothing will wait on it)."""
        if self._issued:
            kept = []
            for s in self._issued:
                if _finished(s):
                    _release(s)
                else:
                    kept.append(s)
            self._issued = kept

    def finish(self, timeout: float) -> None:
        """Every rank has joined: wait for the last stand-ins (a CUDA one by making the stream its
        zeros were allocated on wait for it, so their memory is reused only after NCCL is done),
        and give their done events back."""
        issued, self._issued = self._issued, []
        self.joining = False
        for s in issued:
            for w in s.works:
                w.wait(timeout)
            if s.done_event is not None:
                calls = cuda_calls.calls()
                if not calls.query(s.done_event):
                    device = self._zeros_device()
                    calls.wait(calls.current_stream(device), s.done_event, calls.index(device))
            _release(s)


def _finished(issued: Issued) -> bool:
    if not all(w.done() for w in issued.works):
        return False
    return issued.done_event is None or cuda_calls.calls().query(issued.done_event)


def _release(issued: Issued) -> None:
    """No wait will be enqueued on the stand-in's done event any more: the watchdog may pool it."""
    if issued.release_done is not None:
        issued.release_done()
        issued.release_done = None


__all__ = ["StandIns"]
