"""Horovod-format Chrome-trace timeline: a non-blocking writer, GPU activity timing, and a CLI.

The file is a Chrome ``chrome://tracing`` / Perfetto JSON *array*, written by rank 0 only, in
the exact shape Horovod's ``timeline.cc`` writes (no ``tid`` fields; each op name is a "process"
with its own pid; ``ts`` in integer microseconds since the timeline started, steady clock).

Design notes:

* **Hot path only enqueues.** Every public event method appends one tuple to a
  ``collections.deque`` (atomic under the GIL) and returns; it never formats, locks or touches
  the file. One daemon writer thread wakes every ``flush_interval_s`` (50 ms), formats whatever
  is queued, and writes it with a single ``pwrite``. So a reader sees an event at most ~0.1 s
  after it happened (Horovod's own test reads the file 0.1 s after an op, file still open).
* **Valid JSON after every write.** Each write ends with ``]``; the next write starts at the
  offset of that ``]`` with ``,`` + records + ``]``. A failed write truncates the file back to
  its last valid length, so even a full disk leaves a parseable trace.
* **Never fails the job.** After ``close()`` or after a disk error every event method is a
  silent no-op; the disk error is logged once on ``logging.getLogger("gpucomm.timeline")``.
* **GPU activities** (``GpuActivities``) are timed by CUDA events recorded on the stream; a
  finalizer thread waits for them in order and converts GPU time to timeline time through an
  anchor event (see ``_Anchor``), re-anchored every few seconds to bound clock drift.

``python -m gpucomm.timeline FILE -o out.png`` renders a timeline (see ``timeline_plot``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

__all__ = ["Timeline", "GpuActivities", "GpuOpTrace", "dtype_name", "shape_str", "main"]

log = logging.getLogger("gpucomm.timeline")

# Record kinds in the queue: (kind, name, ts_us, extra).
_B, _E, _X, _E_ARGS, _INSTANT, _FLUSH, _B_ARGS = range(7)

_FLUSH_INTERVAL_S = 0.05  # the writer's wake-up period: events reach the file within ~2x this
_ANCHOR_WINDOW_US = 30.0  # accept a GPU clock anchor whose host window is this tight
_ANCHOR_TRIES = 8


def dtype_name(dtype: Any) -> str:
    """Horovod's dtype spelling ("float32") for a torch/numpy dtype or a string."""
    text = str(dtype)
    return text.rsplit(".", 1)[-1] if text.startswith(("torch.", "numpy.")) else text


def shape_str(shape: Any) -> str:
    """Horovod's shape spelling ("[17, 17]") for a sequence of ints; strings pass through."""
    if isinstance(shape, str):
        return shape
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _json_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class Timeline:
    """Writes Horovod's timeline JSON for one process (rank 0). Event methods are thread-safe
    and non-blocking; ``flush()`` waits for the writer; ``close()`` ends the file.

    Every event method takes the op's name (one timeline "process" per name) and an optional
    ``ts_us`` (µs since the timeline started, from ``now_us()``); the default is now.
    """

    def __init__(self, path: str, *, mark_cycles: bool = False,
                 flush_interval_s: float = _FLUSH_INTERVAL_S) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"timeline path must be a non-empty file name, got {path!r}; "
                             "pass the file the trace should be written to (e.g. timeline.json)")
        self.path = os.fspath(path)
        self.mark_cycles = bool(mark_cycles)
        self._interval = float(flush_interval_s)
        self._queue: collections.deque = collections.deque()
        self._closed = False
        self._close_lock = threading.Lock()
        self._wake = threading.Event()
        self._t0_ns = time.perf_counter_ns()
        self.start_time_since_epoch_us = time.time_ns() // 1000
        self._fd = _open_for_writing(self.path)
        self._end = 0  # offset of the closing "\n]" of the last good write
        self._pids: dict[str, int] = {}
        self._labels: dict[str, str] = {}
        self._failed = False
        self._bad_record_logged = False
        try:
            self._write_batch(self._header_records(), first=True)
        except OSError as exc:
            os.close(self._fd)
            raise OSError(exc.errno, f"cannot write the timeline header to {self.path!r} "
                          f"({exc.strerror}); check free space and permissions, or choose another "
                          "timeline file") from exc
        self._thread = threading.Thread(target=self._run, name="gpucomm-timeline-writer", daemon=True)
        self._thread.start()
        _OPEN_TIMELINES.add(self)

    # -- clock -------------------------------------------------------------------------------

    def now_us(self) -> float:
        """µs since the timeline started (steady clock), for timestamping events yourself."""
        return (time.perf_counter_ns() - self._t0_ns) * 1e-3

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran or the writer stopped after a disk error."""
        return self._closed

    # -- hot path: enqueue only --------------------------------------------------------------

    def _put(self, kind: int, name: Any, ts_us: float | None, extra: Any) -> None:
        if self._closed:
            return
        if ts_us is None:
            ts_us = (time.perf_counter_ns() - self._t0_ns) * 1e-3
        self._queue.append((kind, name, ts_us, extra))

    def negotiate_start(self, name: str, kind: str, ts_us: float | None = None) -> None:
        """``B NEGOTIATE_<KIND>``: the op's negotiation (request kind, e.g. "allreduce") began."""
        self._put(_B, name, ts_us, "NEGOTIATE_" + kind.upper())

    def negotiate_rank_ready(self, name: str, rank: int, ts_us: float | None = None) -> None:
        """``X`` tick named after ``rank``: that rank reported the op ready."""
        self._put(_X, name, ts_us, str(rank))

    def negotiate_end(self, name: str, ts_us: float | None = None) -> None:
        """``E`` closing the negotiation span."""
        self._put(_E, name, ts_us, None)

    def op_start(self, name: str, response_kind: str, ts_us: float | None = None) -> None:
        """``B <RESPONSE>`` (e.g. ALLREDUCE): the op's execution span began."""
        self._put(_B, name, ts_us, response_kind.upper())

    def activity_start(self, name: str, activity: str, ts_us: float | None = None) -> None:
        """``B <ACTIVITY>`` nested inside the op span (QUEUE, NCCL_ALLREDUCE, ...)."""
        self._put(_B, name, ts_us, activity)

    def activity_end(self, name: str, ts_us: float | None = None) -> None:
        """``E`` closing the innermost open activity of ``name``."""
        self._put(_E, name, ts_us, None)

    def op_end(self, name: str, dtype: Any, shape: Any, ts_us: float | None = None) -> None:
        """``E`` closing the op span, with Horovod's ``{"dtype": ..., "shape": ...}`` args.
        ``dtype``/``shape`` may be strings or torch dtypes/sizes (formatted by the writer)."""
        self._put(_E_ARGS, name, ts_us, (dtype, shape))

    def mark_cycle(self, ts_us: float | None = None) -> None:
        """Global ``CYCLE_START`` instant (only when constructed with ``mark_cycles=True``)."""
        if self.mark_cycles:
            self._put(_INSTANT, None, ts_us, "CYCLE_START")

    def span(self, name: str, label: str, start_us: float, end_us: float,
             args: dict | None = None) -> None:
        """A ``B label``/``E`` pair at given times (e.g. a backward pass on a pseudo-op row);
        ``args`` (JSON-able) go on the ``B`` record."""
        self._put(_B_ARGS if args else _B, name, start_us, (label, args) if args else label)
        self._put(_E, name, end_us, None)

    # -- flush / close -----------------------------------------------------------------------

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until everything enqueued before this call is written to the OS.
        Returns False if the writer did not get there within ``timeout`` seconds or has failed."""
        if self._closed:
            return not self._failed
        done = threading.Event()
        self._queue.append((_FLUSH, None, 0.0, done))
        self._wake.set()
        deadline = time.monotonic() + timeout
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False  # timed out, or close() raced us and the writer is gone
        return not self._failed

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, stop the writer and close the file. Idempotent; later event
        calls are ignored."""
        with self._close_lock:
            if self._closed and not self._thread.is_alive():
                return
            self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("timeline writer for %s did not stop within %.1f s (disk stalled?); "
                        "the last events may be missing", self.path, timeout)
        _OPEN_TIMELINES.discard(self)

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                stopping = self._closed
                self._drain()
                if stopping or self._failed:
                    break
            self._drain()  # events that raced with close()
        except Exception as exc:  # a bug here must not take the training job down
            self._fail(f"timeline writer stopped unexpectedly ({type(exc).__name__}: {exc})")
        finally:
            self._release_waiters()
            try:
                os.close(self._fd)
            except OSError:
                pass

    def _drain(self) -> None:
        """Format and write everything queued, one write per batch; answer flush requests after
        the records queued before them are written."""
        queue, batch = self._queue, []
        while queue and not self._failed:
            for _ in range(min(len(queue), 65536)):
                item = queue.popleft()
                if item[0] == _FLUSH:
                    self._write_pending(batch)
                    batch = []
                    item[3].set()
                else:
                    self._format(item, batch)
            self._write_pending(batch)
            batch = []

    def _write_pending(self, batch: list[str]) -> None:
        if batch and not self._failed:
            try:
                self._write_batch(batch)
            except OSError as exc:
                self._restore_valid_end()
                self._fail(f"cannot write to the timeline file {self.path!r} ({exc.strerror or exc}); "
                           "timeline stopped, the file keeps the events written so far")

    def _write_batch(self, records: list[str], first: bool = False) -> None:
        data = (("[\n" if first else ",\n") + ",\n".join(records) + "\n]").encode("utf-8")
        offset = self._end
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n
        self._end = offset - 2  # the next write replaces the trailing "\n]"

    def _restore_valid_end(self) -> None:
        """After a failed write, cut the file back to the last complete write (ends with ``\n]``)."""
        try:
            os.ftruncate(self._fd, self._end)
            os.pwrite(self._fd, b"\n]", self._end)
        except OSError:
            pass

    def _fail(self, message: str) -> None:
        if not self._failed:
            self._failed = True
            self._closed = True
            log.warning(message)
        self._release_waiters()

    def _release_waiters(self) -> None:
        """Wake every flush() caller still waiting (the writer is gone or has failed)."""
        while True:
            try:
                item = self._queue.popleft()
            except IndexError:
                return
            if item[0] == _FLUSH:
                item[3].set()

    # -- formatting (writer thread only) -------------------------------------------------------

    def _header_records(self) -> list[str]:
        return [
            '{"name": "process_name", "ph": "M", "pid": 0, "args": '
            f'{{"start_time_since_epoch_in_micros": {self.start_time_since_epoch_us}}}}}',
            '{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}',
        ]

    def _pid(self, name: str, out: list[str]) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            out.append(f'{{"name": "process_name", "ph": "M", "pid": {pid}, '
                       f'"args": {{"name": {_json_str(str(name))}}}}}')
            out.append(f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, '
                       f'"args": {{"sort_index": {pid}}}}}')
        return pid

    def _label(self, label: str) -> str:
        text = self._labels.get(label)
        if text is None:
            text = self._labels[label] = _json_str(str(label))
        return text

    def _format(self, item: tuple, out: list[str]) -> None:
        kind, name, ts_us, extra = item
        try:
            ts = round(ts_us)
            if kind == _INSTANT:
                out.append(f'{{"ph": "i", "name": {self._label(extra)}, "ts": {ts}, "s": "g"}}')
                return
            pid = self._pid(name, out)
            if kind == _B:
                out.append(f'{{"ph": "B", "name": {self._label(extra)}, "ts": {ts}, "pid": {pid}}}')
            elif kind == _E:
                out.append(f'{{"ph": "E", "ts": {ts}, "pid": {pid}}}')
            elif kind == _X:
                out.append(f'{{"ph": "X", "name": {self._label(extra)}, "ts": {ts}, "pid": {pid}, "dur": 0}}')
            elif kind == _E_ARGS:
                args = json.dumps({"dtype": dtype_name(extra[0]), "shape": shape_str(extra[1])})
                out.append(f'{{"ph": "E", "ts": {ts}, "pid": {pid}, "args": {args}}}')
            elif kind == _B_ARGS:
                args = json.dumps(extra[1], default=str)
                out.append(f'{{"ph": "B", "name": {self._label(extra[0])}, "ts": {ts}, "pid": {pid}, '
                           f'"args": {args}}}')
        except (TypeError, ValueError, OverflowError) as exc:
            if not self._bad_record_logged:
                self._bad_record_logged = True
                log.warning("timeline dropped a malformed event %r (%s); a caller passed a bad "
                            "timestamp, shape or args", item, exc)


def _open_for_writing(path: str) -> int:
    """Open (create/truncate) the trace file, or raise OSError naming the path and the cause."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        parent = os.path.dirname(os.path.abspath(path))
        hint = ("its directory does not exist; create it first" if not os.path.isdir(parent)
                else "it is a directory; name a file inside it" if os.path.isdir(path)
                else "check the permissions of the file and its directory")
        raise type(exc)(exc.errno, f"cannot open the timeline file {path!r} for writing "
                        f"({exc.strerror}): {hint}, or choose another timeline file") from exc


_OPEN_TIMELINES: "weakref.WeakSet[Timeline]" = weakref.WeakSet()


@atexit.register
def _close_open_timelines() -> None:
    """Write the tail of every timeline still open when the interpreter exits."""
    for timeline in list(_OPEN_TIMELINES):
        timeline.close(timeout=2.0)


# -- GPU activities ------------------------------------------------------------------------------


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
            with self._torch.cuda.device(self.device):
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


# -- CLI -----------------------------------------------------------------------------------------


def _parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gpucomm.timeline",
        description="Render a gpucomm/Horovod timeline (Chrome-trace JSON) as a Gantt chart PNG.")
    parser.add_argument("file", help="timeline JSON written by gpucomm or Horovod (may still be open)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None, help="chart title (default: the file name)")
    parser.add_argument("--window", nargs=2, type=float, metavar=("START_MS", "END_MS"), default=None,
                        help="draw only this time window (ms since timeline start), e.g. one step")
    return parser.parse_args(None if argv is None else list(argv))


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry: render FILE to a PNG, print a one-line summary; exit 2 on a bad input file."""
    args = _parse_args(argv)
    from .timeline_plot import render  # lazy: keep matplotlib out of the hot import path
    try:
        summary = render(args.file, args.output, title=args.title,
                         window_ms=None if args.window is None else tuple(args.window))
    except (OSError, ValueError) as exc:
        print(f"python -m gpucomm.timeline: error: {exc}", file=sys.stderr)
        return 2
    t0, t1 = summary["time_range_ms"]
    print(f"rendered {summary['n_rows']} rows, {summary['n_records']} records "
          f"({summary['n_spans']} spans, {summary['n_markers']} rank ticks), "
          f"{t1 - t0:.3f} ms ({t0:.3f} .. {t1:.3f} ms) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
