"""Every CUDA stream and event call of the data plane, in one place, counted.

The data plane's own CUDA work per collective is a handful of calls: the caller's current
stream, an event recorded on one stream, another stream made to wait on it, a query. They all
go through the process's one ``CudaCalls`` object (``calls()``), on raw handles (``cudaStream_t``,
``cudaEvent_t`` as ints) through CuPy's runtime bindings: C functions, so none of torch's
Python ``Stream``/``Event`` wrapper frames (``torch.cuda.current_stream`` alone is about eight)
run on the hot path. Each record, wait and query is counted in ``hvd.stats()``
(``cuda_event_records``, ``cuda_stream_waits``, ``cuda_event_queries``), so tests and benchmarks
can prove how many a step or an op costs.

A test on a machine without a GPU installs a stand-in (``install``) that counts the same calls,
and may declare CPU tensors GPU ones (``gpu_types``), so the CUDA path's Python work and its
call counts are guarded on CPU. Whether a tensor takes the CUDA path is asked here
(``is_gpu``) and nowhere else in the data plane.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from ..counters import COUNTERS

__all__ = ["CudaCalls", "calls", "install", "is_gpu"]

_NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery returns for work still queued
_DISABLE_TIMING = 2  # cudaEventDisableTiming: cheaper to record, and all a completion event needs
_NON_BLOCKING = 1  # cudaStreamNonBlocking


class CudaCalls:
    """The real CUDA calls (CuPy's runtime on raw handles; torch for the caller's current stream)."""

    gpu_types = frozenset({"cuda"})

    def __init__(self) -> None:
        self._runtime: Any = None
        self._raw_stream: Any = None
        self._streams: dict[int, Any] = {}  # raw handle -> the torch Stream of each stream made here
        self._lock = threading.Lock()

    # -- what runs where -------------------------------------------------------------------------
    def is_gpu(self, device: torch.device) -> bool:
        """Whether ``device``'s tensors take the CUDA path."""
        return device.type in self.gpu_types

    @staticmethod
    def index(device: torch.device) -> int:
        """The CUDA ordinal of ``device`` (the current device when it names none)."""
        return device.index if device.index is not None else torch.cuda.current_device()

    # -- streams -----------------------------------------------------------------------------------
    def current_stream(self, device: torch.device) -> int:
        """The calling thread's current stream on ``device``, as a raw handle."""
        raw = self._raw_stream
        if raw is None:
            raw = self._raw_stream = _raw_stream_lookup()
        return raw(self.index(device))

    def new_stream(self, index: int) -> int:
        """A new stream of the data plane's own on GPU ``index`` (non-blocking: it never serialises
        with the legacy default stream; never one of torch's pooled streams, which user code may
        also be handed), kept for the process's lifetime, as a raw handle."""
        rt = self._rt()
        with _on_device(rt, index):
            handle = rt.streamCreateWithFlags(_NON_BLOCKING)
        stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
        with self._lock:
            self._streams[handle] = stream
        return handle

    def destroy_stream(self, handle: int) -> None:
        """Let go of a stream made by ``new_stream`` (its executor ended; work still queued on it runs
        first: CUDA frees the stream once that work is done)."""
        with self._lock:
            stream = self._streams.pop(handle, None)
        if stream is not None:
            self._rt().streamDestroy(handle)

    def torch_stream(self, index: int, handle: int) -> Any:
        """Raw stream ``handle`` of GPU ``index`` as a torch stream object (the timeline's events,
        torch's stream context and ``record_stream`` need one; off the hot path). Handle 0 is the
        device's default stream (``ExternalStream(0)`` would be a pooled stream instead)."""
        stream = self._streams.get(handle)
        if stream is None:
            if handle == 0:
                return torch.cuda.default_stream(index)
            stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
        return stream

    def stream_context(self, index: int, handle: int) -> ContextManager:
        """Make raw stream ``handle`` on GPU ``index`` current for torch ops in a ``with`` block."""
        return torch.cuda.stream(self.torch_stream(index, handle))

    def keep_alive(self, tensor: torch.Tensor, index: int, handle: int) -> None:
        """Tell torch's caching allocator that ``tensor`` is used on stream ``handle``: its memory is
        not handed out again until the work queued there so far has run."""
        tensor.record_stream(self.torch_stream(index, handle))

    def read_later(self, tensor: torch.Tensor) -> Any:
        """Start copying ``tensor`` (a few values) to pinned host memory on the current stream; what
        ``read_if_done`` takes (no host sync now)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)  # queued on the current stream of the tensor's device
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        return host, done

    def read_if_done(self, token: Any) -> torch.Tensor | None:
        """The host copy started by ``read_later`` once it has arrived, else None (never waits)."""
        host, done = token
        return host if done.query() else None

    def read_now(self, token: Any) -> torch.Tensor:
        """The host copy started by ``read_later``, waiting for it."""
        host, done = token
        done.synchronize()
        return host

    # -- events ------------------------------------------------------------------------------------
    # CUDA records an event only on its own device's streams, and a stream waits only on its own
    # device (what torch's CUDAEvent guards): each call runs with GPU ``index`` current, switched to
    # only when the calling thread has another one current (a user thread that never picked one).
    def new_event(self, index: int) -> int:
        """A new event (timing off) on GPU ``index``."""
        rt = self._rt()
        with _on_device(rt, index):
            return rt.eventCreateWithFlags(_DISABLE_TIMING)

    def destroy_event(self, event: int) -> None:
        self._rt().eventDestroy(event)

    def record(self, event: int, stream: int, index: int) -> None:
        """Record ``event`` on ``stream`` of GPU ``index``: it completes once the work queued there so
        far has run."""
        COUNTERS.cuda_event_records += 1
        rt = self._rt()
        if rt.getDevice() == index:
            rt.eventRecord(event, stream)
            return
        with _on_device(rt, index):
            rt.eventRecord(event, stream)

    def wait(self, stream: int, event: int, index: int) -> None:
        """Make ``stream`` of GPU ``index`` wait for ``event`` in its later work (the host does not wait)."""
        COUNTERS.cuda_stream_waits += 1
        rt = self._rt()
        if rt.getDevice() == index:
            rt.streamWaitEvent(stream, event, 0)
            return
        with _on_device(rt, index):
            rt.streamWaitEvent(stream, event, 0)

    def query(self, event: int) -> bool:
        """True once ``event``'s work has run; raises CUDA's error if that work failed."""
        COUNTERS.cuda_event_queries += 1
        rt = self._rt()
        status = rt.eventQuery(event)
        if status == 0:
            return True
        try:
            rt.check_status(status)  # clears the error CUDA recorded for this thread, then raises
        except rt.CUDARuntimeError:
            if status == _NOT_READY:  # not an error: cleared, so torch's next launch check does not see it
                return False
            raise
        return False

    def _rt(self) -> Any:
        rt = self._runtime
        if rt is None:
            from cupy.cuda import runtime  # noqa: PLC0415 - CuPy loads with the first CUDA collective

            rt = self._runtime = runtime
        return rt


def _on_device(rt: Any, index: int) -> ContextManager:
    """GPU ``index`` current for a ``with`` block, or nothing when it already is. torch's guard: on
    exit it gives torch's own view of the thread's device back, without making a context on a GPU
    that had none; the CUDA runtime's current device may stay ``index`` (what CuPy and Numba then
    see), which gpucomm's calls never rely on: each compares the device it needs first."""
    if rt.getDevice() == index:
        return nullcontext()
    return torch.cuda.device(index)


def _raw_stream_lookup():
    """torch's C getter of the current raw stream (``torch._C._cuda_getCurrentRawStream``, what
    torch's own ``Stream.cuda_stream`` reads), or the public Python route where a build lacks it."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_calls: CudaCalls = CudaCalls()


def calls() -> CudaCalls:
    """The process's CUDA calls (the real ones, or a test's stand-in)."""
    return _calls


def is_gpu(device: torch.device) -> bool:
    """Whether ``device``'s tensors take the data plane's CUDA path."""
    return device.type in _calls.gpu_types


def install(stand_in: CudaCalls | None) -> CudaCalls:
    """Use ``stand_in`` for every CUDA call of the data plane from now on (None: the real calls
    again); returns what was in use. For tests on machines without a GPU."""
    global _calls
    previous, _calls = _calls, (stand_in if stand_in is not None else CudaCalls())
    return previous
