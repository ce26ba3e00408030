"""Horovod-format Chrome-trace timeline: the non-blocking writer.

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
* **GPU activities** are timed by CUDA events (``gpu.py``); ``python -m gpucomm.timeline FILE -o
  out.png`` renders a timeline (``plot.py``).
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["Timeline", "dtype_name", "shape_str"]

log = logging.getLogger("gpucomm.timeline")

# Record kinds in the queue: (kind, name, ts_us, extra).
_B, _E, _X, _E_ARGS, _INSTANT, _FLUSH, _B_ARGS = range(7)

_FLUSH_INTERVAL_S = 0.05  # the writer's wake-up period: events reach the file within ~2x this


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
