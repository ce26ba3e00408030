"""Compiling the kernel variants on first use and launching them on a torch stream.

Host cost matters: pack runs inside backward hooks. Each variant has one signature of three
scalars, so Numba compiles it once (eagerly, for that signature) and the dispatcher needs no type
inference per call. Two launch paths:

* ``direct`` (default): the compiled function is fetched from Numba once per device and launched
  with ``cuda.core.launch`` on a cached ``cuda.core`` stream and launch config, with the three
  scalars packed as ctypes values exactly as Numba packs them. This skips Numba's per-call
  launch-config specialisation, argument marshalling loop and ``LaunchConfig`` construction.
* ``numba``: the documented ``kernel[grid, block, stream](...)`` on a cached
  ``numba.cuda.external_stream`` of the torch stream (the configured kernel is cached too).

Measured on the CPU box with the driver calls stubbed out (``cuda.core.launch`` and Numba's
context lookup replaced by no-ops), the Python work per launch was 8.4 us through Numba's
dispatcher and 0.4 us on the direct path; both then pay for ``cuda.core.launch`` itself, and the
Numba path also for a driver context query. Real numbers come from ``benchmarks/pack_bw.py``.

``GPUCOMM_KERNEL_LAUNCH=numba`` forces the second; the first falls back to it (with a warning) if
Numba's internals it reaches for are missing. The simulator always launches through Numba, with
32 threads per block and at most 4 blocks (each simulated thread is a Python thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import warnings
from typing import Any

import numpy as np
import torch
from numba import cuda

from ..errors import KernelUnavailableError
from .devicefns import SIMULATOR
from .specs import KernelSpec

__all__ = ["BLOCK", "grid_for", "launch", "launch_mode"]

log = logging.getLogger("gpucomm.kernels")

BLOCK = 32 if SIMULATOR else 256  # threads per block: 8 warps on a GPU, 1 warp in the simulator
WARPS_PER_BLOCK = BLOCK // 32
MAX_GRID = 1 << 16
SIM_MAX_BLOCKS = 4

_lock = threading.Lock()
_compiled: dict[str, Any] = {}  # spec name -> Numba dispatcher (simulator: FakeCUDAKernel)
_direct: dict[tuple[str, int], Any] = {}  # (spec name, device index) -> cuda.core kernel
_core_streams: dict[int, Any] = {}
_numba_streams: dict[int, Any] = {}
_numba_configs: dict[tuple[str, int, int], Any] = {}  # (spec, grid, stream) -> configured kernel
_core_configs: dict[int, Any] = {}  # grid -> cuda.core LaunchConfig
_thread = threading.local()  # .devices: GPUs with a context made current in this thread
_direct_broken = False

try:  # what Numba itself launches with; missing pieces only disable the direct path
    from cuda.core import LaunchConfig as _LaunchConfig, Stream as _CoreStream, launch as _core_launch
except ImportError:  # pragma: no cover - numba-cuda depends on cuda.core
    _LaunchConfig = _CoreStream = _core_launch = None


def launch_mode() -> str:
    """``direct`` or ``numba`` (``GPUCOMM_KERNEL_LAUNCH``; the simulator is always ``numba``)."""
    if SIMULATOR:
        return "numba"
    mode = os.environ.get("GPUCOMM_KERNEL_LAUNCH", "direct").strip().lower() or "direct"
    if mode not in ("direct", "numba"):
        raise ValueError(f"GPUCOMM_KERNEL_LAUNCH={mode!r} is not a launch mode; use 'direct' (default) or 'numba'.")
    return "numba" if _direct_broken else mode


def grid_for(nrows: int, device: torch.device) -> int:
    """Blocks for ``nrows`` rows: one warp per row, so the block scheduler balances the work; only
    beyond ``MAX_GRID`` blocks (half a million rows) do warps stride over several rows."""
    if SIMULATOR:
        return max(1, min(nrows, SIM_MAX_BLOCKS))
    return max(1, min(-(-nrows // WARPS_PER_BLOCK), MAX_GRID))


def _compile(spec: KernelSpec, device: torch.device) -> Any:
    kernel = _compiled.get(spec.name)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _compiled.get(spec.name)
        if kernel is None:
            if SIMULATOR:
                kernel = cuda.jit(spec.pyfunc)
            else:
                from numba.cuda import types  # noqa: PLC0415

                try:
                    kernel = cuda.jit(types.void(*spec.argtypes))(spec.pyfunc)
                except Exception as e:  # toolkit pieces missing, driver too old, ...
                    raise KernelUnavailableError(
                        f"compiling the pack kernel {spec.name!r} for {device} failed: {type(e).__name__}: {e}. "
                        "Likely causes: numba-cuda cannot find NVRTC/NVVM (install 'numba-cuda[cu13]' or "
                        "'numba-cuda[cu12]', matching the CUDA version `nvidia-smi` reports), or the driver is "
                        "older than that toolkit. Fix the installation, or pack CPU tensors with "
                        "gpucomm.dataplane.fusion instead.") from e
            _compiled[spec.name] = kernel
    return kernel


def _device_guard(device: torch.device):
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def _scale_arg(spec: KernelSpec, scale: float):
    return np.float64(scale) if spec.uses_float64 else np.float32(scale)


def launch(spec: KernelSpec, table_address: int, nrows: int, grid: int, scale: float,
           device: torch.device, stream: Any) -> None:
    """Launch ``spec`` over a table of ``nrows`` rows at ``table_address`` on torch ``stream``."""
    if SIMULATOR:
        _compile(spec, device)[grid, BLOCK](np.uint64(table_address), np.int64(nrows), _scale_arg(spec, scale))
        return
    with _device_guard(device):
        kernel = _compile(spec, device)
        if launch_mode() == "direct":
            try:
                _launch_direct(spec, kernel, table_address, nrows, grid, scale, device, stream)
                return
            except (AttributeError, ImportError, TypeError, StopIteration) as e:
                _give_up_direct(e)
        configured = _numba_configs.get((spec.name, grid, stream.cuda_stream))
        if configured is None:
            configured = _configure_numba(spec, kernel, grid, stream.cuda_stream)
        configured(np.uint64(table_address), np.int64(nrows), _scale_arg(spec, scale))


def _configure_numba(spec: KernelSpec, kernel: Any, grid: int, handle: int) -> Any:
    nb_stream = _numba_streams.get(handle) if handle else 0
    if nb_stream is None:
        nb_stream = _numba_streams[handle] = cuda.external_stream(handle)
    with warnings.catch_warnings():  # small grids are deliberate here (few rows), not an occupancy bug
        warnings.simplefilter("ignore")
        configured = _numba_configs[(spec.name, grid, handle)] = kernel[grid, BLOCK, nb_stream]
    return configured


def _launch_direct(spec: KernelSpec, kernel: Any, table_address: int, nrows: int, grid: int, scale: float,
                   device: torch.device, stream: Any) -> None:
    if _core_launch is None:
        raise ImportError("cuda.core is not installed")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _thread_devices():
        _ensure_context(index)
    core_kernel = _direct.get((spec.name, index))
    if core_kernel is None:
        # Numba's own launch does the same: overload -> code library -> cufunc (loaded on this device)
        overload = next(iter(kernel.overloads.values()))
        core_kernel = _direct[(spec.name, index)] = overload._codelibrary.get_cufunc().kernel
    handle = stream.cuda_stream
    core_stream = _core_streams.get(handle)
    if core_stream is None:
        core_stream = _core_streams[handle] = _CoreStream.from_handle(handle)
    config = _core_configs.get(grid)
    if config is None:
        config = _core_configs[grid] = _LaunchConfig(grid=(grid, 1, 1), block=(BLOCK, 1, 1), shmem_size=0)
    scale_c = ctypes.c_double(scale) if spec.uses_float64 else ctypes.c_float(scale)
    _core_launch(core_stream, config, core_kernel, ctypes.c_uint64(table_address), ctypes.c_int64(nrows), scale_c)


def _thread_devices() -> set[int]:
    devices = getattr(_thread, "devices", None)
    if devices is None:
        devices = _thread.devices = set()
    return devices


def _ensure_context(index: int) -> None:
    """Make sure a CUDA context is current in this thread before the first direct launch.

    A thread that has not run CUDA work yet (a fresh hook or worker thread) may have none, and
    a driver-level launch then fails with CUDA_ERROR_INVALID_CONTEXT; CUDA's runtime (torch) and
    Numba bind the device's primary context in that case, and so does this."""
    from cuda.bindings import driver  # noqa: PLC0415

    err, ctx = driver.cuCtxGetCurrent()
    if err == driver.CUresult.CUDA_SUCCESS and int(ctx) == 0:
        err, dev = driver.cuDeviceGet(index)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, primary = driver.cuDevicePrimaryCtxRetain(dev)
        if err == driver.CUresult.CUDA_SUCCESS:
            (err,) = driver.cuCtxSetCurrent(primary)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise KernelUnavailableError(f"cannot make a CUDA context current for GPU {index} in this thread: {err}")
    _thread_devices().add(index)


def _give_up_direct(error: BaseException) -> None:
    global _direct_broken
    _direct_broken = True
    log.warning("gpucomm: direct kernel launch unavailable with this numba-cuda/cuda-core (%s: %s); "
                "using Numba's launch path (a few microseconds more per launch).", type(error).__name__, error)
