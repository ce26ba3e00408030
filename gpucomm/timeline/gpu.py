"""GPU activity timing for the timeline: CUDA events recorded on the stream, converted to timeline
time by a finalizer thread through an anchor event (re-anchored every few seconds to bound drift).
Importing this module needs no CUDA; ``GpuActivities`` needs a CUDA device.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Sequence

from .writer import Timeline

log = logging.getLogger("gpucomm.timeline")

_ANCHOR_WINDOW_US = 30.0  # accept a GPU clock anchor whose host window is this tight
_ANCHOR_TRIES = 8

class _Anchor:
    """One CUDA event whose timeline time is known: ``event.elapsed_time(e)`` (ms, GPU clock)
    then converts any later event ``e`` on the same device to timeline µs.

    The event is recorded on ``stream``, a high-priority stream kept idle for anchors, so the
    GPU stamps it within a few µs of the host's ``record``; its timeline time is the midpoint
    of the tightest record→synchronize window (error ≈ half that window, usually < 10 µs).
    Windows wider than ``_ANCHOR_WINDOW_US`` (a busy GPU front end, a preempted thread) are
    retried a few times."""

    def __init__(self, torch_mod: Any, stream: Any, timeline: Timeline) -> None:
        best = None
        with torch_mod.cuda.device(stream.device):
            for _ in range(_ANCHOR_TRIES):
                event = torch_mod.cuda.Event(enable_timing=True)
                before = timeline.now_us()
                event.record(stream)
                event.synchronize()
                after = timeline.now_us()
                if best is None or after - before < best[2] - best[1]:
                    best = (event, before, after)
                if after - before <= _ANCHOR_WINDOW_US:
                    break
        self.event, self.us = best[0], (best[1] + best[2]) / 2
        self.window_us = best[2] - best[1]
        self.made_at = time.monotonic()

    def to_us(self, event: Any) -> float:
        return self.us + self.event.elapsed_time(event) * 1000.0


class GpuOpTrace:
    """The CUDA events of one (possibly fused) op: ``step(label)`` after enqueueing each
    activity's work, then ``submit()``. Activity k spans from event k-1 to event k, as in
    Horovod. Created by ``GpuActivities.trace``; use from one thread."""

    __slots__ = ("_owner", "names", "kind", "anchor", "floor_us", "events", "labels")

    def __init__(self, owner: "GpuActivities", names: Sequence[str], kind: str | None, stream: Any) -> None:
        self._owner = owner
        self.names = names
        self.kind = kind
        self.anchor = owner._anchor
        self.floor_us = owner.timeline.now_us()
        self.labels: list[str] = []
        self.events = [owner._record(stream)]

    def step(self, label: str, stream: Any = None) -> None:
        """Mark the end of activity ``label`` (its work is enqueued on ``stream``, default the
        current stream); it started where the previous step (or the trace) ended."""
        self.labels.append(label)
        self.events.append(self._owner._record(stream))

    def submit(self, dtype: Any = None, shape: Any = None) -> None:
        """Hand the events to the finalizer. With ``dtype``/``shape`` the finalizer also emits
        ``op_end`` at the last event's time, so the op span encloses its GPU activities."""
        self._owner._submit(self, None if dtype is None else (dtype, shape))


class GpuActivities:
    """Times timeline activities with CUDA events and emits them from a finalizer thread.

    ``trace = gpu.trace(names, "allreduce")`` records a start event on the stream;
    ``trace.step(label)`` records the end of each activity; ``trace.submit(dtype, shape)``
    queues the trace. The finalizer waits for the events in order (``event.synchronize()``;
    blocking-sync events, so it sleeps rather than spins) and writes, for every name (all
    tensors of a fused batch get identical records): ``op_start`` (if a response kind was
    given), ``activity_start``/``activity_end`` per step, ``op_end`` (if dtype was given).

    Ordering: the host runs ahead of the GPU, so the next op on a name can be enqueued before
    the previous one finished on the GPU. The finalizer therefore starts each op no earlier
    than the previous op of the same names ended, keeping B/E nested per pid. Let it emit the
    op's start and end (pass ``response_kind`` and ``dtype``) rather than calling
    ``Timeline.op_start`` on the host. Event times come from an anchor (see ``_Anchor``)
    replaced every ``reanchor_s`` seconds; events are pooled and reused."""

    def __init__(self, timeline: Timeline, device: Any = None, *, reanchor_s: float = 5.0) -> None:
        import torch  # lazy: importing gpucomm.timeline must not need CUDA

        if not torch.cuda.is_available():
            raise RuntimeError("GpuActivities needs a CUDA device, but torch.cuda.is_available() is "
                               "False; use Timeline.activity_start/activity_end with CPU times instead")
        self._torch = torch
        self.timeline = timeline
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.reanchor_s = float(reanchor_s)
        # high priority: a different pool than the default-priority streams collectives use
        self._anchor_stream = torch.cuda.Stream(self.device, priority=-1)
        self._anchor = _Anchor(torch, self._anchor_stream, timeline)
        self._pool: collections.deque = collections.deque()
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._failed = False
        self._last_end: dict[str, float] = {}  # finalizer thread only
        self._thread = threading.Thread(target=self._run, name="gpucomm-timeline-finalizer", daemon=True)
        self._thread.start()

    def trace(self, names: str | Sequence[str], response_kind: str | None = None,
              stream: Any = None) -> GpuOpTrace:
        """Start timing one op (or a fused batch: a list of names) on ``stream`` (default: the
        current stream). With ``response_kind`` (e.g. "allreduce") the op span's ``B`` is
        emitted too, at this call's host time (or when the previous op on the names ended)."""
        names = [names] if isinstance(names, str) else list(names)
        return GpuOpTrace(self, names, None if response_kind is None else response_kind.upper(), stream)

    def close(self, timeout: float = 10.0) -> None:
        """Emit what was submitted (waits for its events) and stop the finalizer. Idempotent."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    def _record(self, stream: Any) -> Any:
        try:
            event = self._pool.popleft()
        except IndexError:
            event = self._torch.cuda.Event(enable_timing=True, blocking=True)
        if stream is None:
            stream = self._torch.cuda.current_stream(self.device)
        event.record(stream)
        return event

    def _submit(self, trace: GpuOpTrace, end: tuple | None) -> None:
        if self._closed or self.timeline.closed:
            self._pool.extend(trace.events)
            return
        self._pending.append((trace, end))
        self._wake.set()

    # -- finalizer thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # select, never ``with torch.cuda.device(...)``: leaving that block would select the device
            # current before, which in a new thread is GPU 0 (a context there for every rank)
            self._torch.cuda.set_device(self.device)
            while True:
                self._wake.wait(0.5)
                self._wake.clear()
                stopping = self._closed
                while self._pending:
                    self._finalize(*self._pending.popleft())
                if stopping:
                    return
                self._maybe_reanchor()
        except Exception as exc:  # never take the training job down
            self._failed = self._closed = True
            log.warning("timeline GPU finalizer stopped (%s: %s); GPU activities after this point "
                        "are not in the timeline", type(exc).__name__, exc)

    def _maybe_reanchor(self) -> None:
        if time.monotonic() - self._anchor.made_at >= self.reanchor_s:
            self._anchor = _Anchor(self._torch, self._anchor_stream, self.timeline)

    def _finalize(self, trace: GpuOpTrace, end: tuple | None) -> None:
        start_us = max([trace.floor_us] + [self._last_end.get(n, 0.0) for n in trace.names])
        times = self._event_times(trace, start_us)
        timeline = self.timeline
        for name in trace.names:
            if trace.kind is not None:
                timeline.op_start(name, trace.kind, start_us)
            for label, start, stop in zip(trace.labels, times, times[1:]):
                timeline.activity_start(name, label, start)
                timeline.activity_end(name, stop)
            if end is not None:
                timeline.op_end(name, end[0], end[1], times[-1])
            self._last_end[name] = times[-1]
        self._pool.extend(trace.events)

    def _event_times(self, trace: GpuOpTrace, floor: float) -> list[float]:
        """Timeline µs of each event, waiting for them in order; clamped to be non-decreasing
        and not before ``floor`` (the op's start), so activities always nest inside the op."""
        times = []
        for event in trace.events:
            event.synchronize()
            floor = max(floor, trace.anchor.to_us(event))
            times.append(floor)
        self._maybe_reanchor()
        return times


__all__ = ["GpuActivities", "GpuOpTrace"]
