"""What the communication paths tell the timeline (rank 0 only; every call is cheap and never raises).

``Tracer`` sits between the hot paths and ``gpucomm.timeline``: the coordinator reports
negotiation (``NEGOTIATE_<KIND>`` with a tick per rank), the executor reports each collective
(``GLOO_<KIND>`` or ``MPI_<KIND>`` timed from issue to the backend's completion callback on CPU; ``QUEUE`` and
``NCCL_<KIND>`` timed by CUDA events on GPU), and the optimizer reports its fusion-buffer copies
and the backward pass, so the picture shows bucket allreduces overlapping backward.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from .gpu import GpuActivities
from .writer import Timeline, dtype_name, shape_str

log = logging.getLogger("gpucomm.timeline")


class Tracer:
    """Rank 0's timeline and the vocabulary the rest of gpucomm uses to fill it."""

    def __init__(self, path: str, *, mark_cycles: bool = False) -> None:
        self.timeline = Timeline(path, mark_cycles=mark_cycles)
        self._dtype_name, self._shape_str = dtype_name, shape_str
        self.path = path
        self._gpu: Any = None  # GpuActivities, made by the first CUDA collective

    # -- coordinator (negotiation) ------------------------------------------------------------
    def negotiate_start(self, name: str, kind: str) -> None:
        self.timeline.negotiate_start(name, kind)

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        self.timeline.negotiate_rank_ready(name, rank)

    def negotiate_end(self, name: str) -> None:
        self.timeline.negotiate_end(name)

    def cycle(self) -> None:
        self.timeline.mark_cycle()

    # -- executor -----------------------------------------------------------------------------
    def cpu_op(self, name: str, kind: str, tensors: Sequence[Any], works: Sequence[Any], transport: str = "gloo") -> None:
        """A CPU collective was issued: its activity (``MPI_<KIND>`` on MPI, else ``GLOO_<KIND>``)
        lasts until the last backend work completes."""
        tl = self.timeline
        tl.op_start(name, kind)
        tl.activity_start(name, f"{'MPI' if transport == 'mpi' else 'GLOO'}_{kind.upper()}")
        dtype, shape = self._describe(tensors)
        futures = [w.future() for w in works]
        futures = [f for f in futures if f is not None]
        if not futures:
            tl.activity_end(name)
            tl.op_end(name, dtype, shape)
            return
        remaining = [len(futures)]
        counting = threading.Lock()  # Gloo runs an op's works on several threads: their callbacks may race

        def done(_fut: Any) -> None:
            with counting:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                tl.activity_end(name)
                tl.op_end(name, dtype, shape)

        for f in futures:
            f.add_done_callback(done)

    def inline_op(self, name: str, kind: str, tensors: Sequence[Any]) -> None:
        """A small allreduce the coordinator reduced: it completed with its negotiation."""
        tl = self.timeline
        now = tl.now_us()
        tl.op_start(name, kind, now)
        tl.span(name, "COORDINATOR_REDUCE", now, now)
        tl.op_end(name, *self._describe(tensors), now)

    def _describe(self, tensors: Sequence[Any]) -> tuple[str, str]:
        """Horovod's dtype and shape args for an op (a grouped op shows its tensor count)."""
        dtype = self._dtype_name(tensors[0].dtype) if tensors else "none"
        shape = self._shape_str(tensors[0].shape) if len(tensors) == 1 else f"[{len(tensors)} tensors]"
        return dtype, shape

    def gpu_op(self, name: str, kind: str, stream: Any):
        """Start timing a CUDA collective on ``stream``; the caller marks ``step``s and ``submit``s."""
        if self._gpu is None:
            # the stream's own device: the thread tracing may not have selected it (nor GPU 0)
            self._gpu = GpuActivities(self.timeline, device=stream.device)
        return self._gpu.trace(name, kind, stream=stream)

    # -- optimizer ----------------------------------------------------------------------------
    def now_us(self) -> float:
        return self.timeline.now_us()

    def span(self, name: str, label: str, start_us: float, end_us: float) -> None:
        self.timeline.span(name, label, start_us, end_us)

    def close(self) -> None:
        try:
            if self._gpu is not None:
                self._gpu.close()
        finally:
            self.timeline.close()


__all__ = ["Tracer"]
