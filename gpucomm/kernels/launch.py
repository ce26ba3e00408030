"""Compiling the kernel variants once per process, and launching them with as little host work as
Python allows.

Host cost matters: pack runs inside backward hooks. Each variant has one signature of three
scalars (table address, row count, scale), so Numba compiles it once, eagerly. A ``Launch`` is
prepared per table: the kernel handle, the grid and the three arguments already packed as the
``void*[]`` array the driver reads. Launching it is then one driver call. Three paths, chosen by
``GPUCOMM_KERNEL_LAUNCH``:

* ``driver`` (default): ``cuda.bindings.driver.cuLaunchKernel`` with the prepared parameter array's
  address: no per-call argument marshalling at all.
* ``core``: ``cuda.core.launch`` (what Numba itself calls), with a cached stream wrapper, launch
  config and the prepared ctypes arguments.
* ``numba``: the documented ``kernel[grid, block, stream](...)``.

A path that fails on its first use (a binding that differs in this cuda-python/numba-cuda
release) is given up with one warning and the next one is used. The simulator always launches
through Numba, with 32 threads per block and at most 4 blocks (each simulated thread is a Python
thread).

Compilation goes through ``compat.prepare_numba_cuda`` first (NumPy 2.5 support). A failed compile
is remembered: the same ``KernelUnavailableError`` is raised again without compiling again.
"""

from __future__ import annotations

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
from ..settings import KERNEL_LAUNCH
from . import compat
from .devicefns import SIMULATOR
from .specs import KernelSpec

__all__ = ["BLOCK", "Launch", "grid_for", "launch_mode", "compiled_names", "compile_kernel", "compile_ptx"]

log = logging.getLogger("gpucomm.kernels")

BLOCK = 32 if SIMULATOR else 256  # threads per block: 8 warps on a GPU, 1 warp in the simulator
WARPS_PER_BLOCK = BLOCK // 32
MAX_GRID = 1 << 16
SIM_MAX_BLOCKS = 4
MODES = ("driver", "core", "numba")

_lock = threading.Lock()
_compiled: dict[str, Any] = {}  # spec name -> Numba dispatcher (simulator: FakeCUDAKernel)
_failed: dict[str, KernelUnavailableError] = {}  # spec name -> why it did not compile (never retried)
_functions: dict[tuple[str, int], Any] = {}  # (spec name, device index) -> Numba's loaded function
_core_streams: dict[int, Any] = {}
_numba_streams: dict[int, Any] = {}
_numba_configs: dict[tuple[str, int, int], Any] = {}  # (spec, grid, stream) -> configured kernel
_core_configs: dict[int, Any] = {}  # grid -> cuda.core LaunchConfig
_NUMPY_OF = {ctypes.c_uint64: np.uint64, ctypes.c_int64: np.int64, ctypes.c_float: np.float32,
             ctypes.c_double: np.float64}  # each argument as the simulator and Numba's own launch take it
_thread = threading.local()  # .devices: GPUs with a context made current in this thread
_broken: set[str] = set()  # launch paths given up in this process
_modes: dict[Any, str] = {}  # GPUCOMM_KERNEL_LAUNCH as set (None: unset) -> the path it resolves to now

try:  # what Numba itself launches with; missing pieces only disable those paths
    from cuda.core import LaunchConfig as _LaunchConfig, Stream as _CoreStream, launch as _core_launch
except ImportError:  # pragma: no cover - numba-cuda depends on cuda.core
    _LaunchConfig = _CoreStream = _core_launch = None
try:
    from cuda.bindings import driver as _driver
except ImportError:  # pragma: no cover - numba-cuda depends on cuda-bindings
    _driver = None


def launch_mode() -> str:
    """The launch path in use: ``GPUCOMM_KERNEL_LAUNCH`` (``driver``, ``core`` or ``numba``), or the
    next one if it was given up; the simulator always uses ``numba``. (Cached per setting.)"""
    if SIMULATOR:
        return "numba"
    given = KERNEL_LAUNCH.given(os.environ)
    mode = _modes.get(given)
    if mode is None:
        mode = _modes[given] = _resolve_mode(KERNEL_LAUNCH.read(os.environ, "driver"))
    return mode


def _resolve_mode(mode: str) -> str:
    """The first path from ``mode`` on (driver, core, numba) that was not given up."""
    for candidate in MODES[MODES.index(mode):]:
        if candidate not in _broken:
            return candidate
    return "numba"


def compiled_names() -> list[str]:
    return list(_compiled)


def grid_for(nrows: int, device: torch.device) -> int:
    """Blocks for ``nrows`` rows: one warp per row, so the block scheduler balances the work; only
    beyond ``MAX_GRID`` blocks (half a million rows) do warps stride over several rows."""
    if SIMULATOR:
        return max(1, min(nrows, SIM_MAX_BLOCKS))
    return max(1, min(-(-nrows // WARPS_PER_BLOCK), MAX_GRID))


def compile_kernel(spec: KernelSpec, device: torch.device) -> Any:
    """``spec`` compiled for its one signature (once per process); KernelUnavailableError if it cannot be."""
    kernel = _compiled.get(spec.name)
    if kernel is not None:
        return kernel
    failure = _failed.get(spec.name)
    if failure is not None:
        raise failure
    with _lock:
        kernel = _compiled.get(spec.name)
        if kernel is None:
            if spec.name in _failed:
                raise _failed[spec.name]
            kernel = _compiled[spec.name] = _compile_now(spec, device)
    return kernel


def compile_ptx(spec: KernelSpec, cc: tuple[int, int]) -> str:
    """PTX of ``spec`` for compute capability ``cc``, compiled as for a launch but with no GPU needed
    (``compat`` applied first): how CI proves every variant builds on this CUDA Python stack."""
    compat.prepare_numba_cuda()
    ptx, _ = cuda.compile_ptx(spec.pyfunc, tuple(spec.argtypes), cc=cc)
    return ptx


def _compile_now(spec: KernelSpec, device: torch.device) -> Any:
    if SIMULATOR:
        return cuda.jit(spec.pyfunc)
    from numba.cuda import types  # noqa: PLC0415

    try:
        compat.prepare_numba_cuda()
        return cuda.jit(types.void(*spec.argtypes))(spec.pyfunc)
    except Exception as e:  # toolkit pieces missing, driver too old, a NumPy numba-cuda does not know, ...
        error = KernelUnavailableError(
            f"compiling the pack kernel {spec.name!r} for {device} failed: {type(e).__name__}: {e}. Likely causes: "
            "numba-cuda cannot find NVRTC/NVVM (install 'numba-cuda[cu13]' or 'numba-cuda[cu12]', matching the CUDA "
            "version `nvidia-smi` reports), the driver is older than that toolkit, or numba-cuda does not support "
            "this NumPy (see gpucomm/kernels/compat.py). Fix the installation, or set GPUCOMM_FUSION_KERNELS=0 to "
            "pack with torch ops.")
        error.__cause__ = e
        _failed[spec.name] = error
        raise error from e


class Launch:
    """One kernel over one table, ready to launch on any stream of its device: the handle, grid and
    packed arguments are built once, so a launch is one driver call."""

    __slots__ = ("spec", "grid", "nrows", "device", "index", "_kernel", "_function", "_args", "_params",
                 "_params_address", "_np_args")

    def __init__(self, spec: KernelSpec, table_address: int, nrows: int, grid: int, scale: float,
                 device: torch.device, flags_address: int = 0) -> None:
        if spec.checked and not flags_address:
            raise ValueError(f"the checked kernel {spec.name!r} needs the address of its per-row flags")
        scale_c = ctypes.c_double(scale) if spec.uses_float64 else ctypes.c_float(scale)
        args = [ctypes.c_uint64(table_address), ctypes.c_int64(nrows), scale_c]
        if spec.checked:  # the fourth parameter: where the kernel flags the rows holding Inf or NaN
            args.append(ctypes.c_uint64(flags_address))
        self._prepare(spec, grid, nrows, device, args)

    @classmethod
    def with_args(cls, spec: KernelSpec, grid: int, device: torch.device, args: list) -> "Launch":
        """A launch of a kernel of another signature (``spec.params``): ``args`` are its ctypes scalars, in
        order (``set_arg`` changes one between launches)."""
        launch = cls.__new__(cls)
        launch._prepare(spec, grid, 0, device, args)
        return launch

    def _prepare(self, spec: KernelSpec, grid: int, nrows: int, device: torch.device, args: list) -> None:
        self.spec, self.grid, self.nrows, self.device = spec, grid, nrows, device
        self.index = -1 if SIMULATOR or device.type != "cuda" else (
            device.index if device.index is not None else torch.cuda.current_device())
        self._args = tuple(args)
        self._np_args = tuple(_NUMPY_OF[type(a)](a.value) for a in self._args)
        self._params = (ctypes.c_void_p * len(self._args))(*(ctypes.addressof(a) for a in self._args))
        self._params_address = ctypes.addressof(self._params)
        self._kernel = compile_kernel(spec, device)
        self._function = None

    def set_arg(self, i: int, value: int | float) -> None:
        """Argument ``i`` of the next launches (a launch reads its arguments when it is queued)."""
        arg = self._args[i]
        if arg.value != value:
            arg.value = value
            self._np_args = (*self._np_args[:i], _NUMPY_OF[type(arg)](value), *self._np_args[i + 1:])

    def __call__(self, stream: Any) -> None:
        """Launch on ``stream`` (a torch.cuda.Stream; ignored in the simulator)."""
        if SIMULATOR:
            self._kernel[self.grid, BLOCK](*self._np_args)
            return
        index = self.index
        if index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self._launch(stream, index)
        else:
            self._launch(stream, index)

    def _launch(self, stream: Any, index: int) -> None:
        devices = getattr(_thread, "devices", None)
        if devices is None or index not in devices:
            _ensure_context(index)
        mode = launch_mode()
        if mode == "driver":
            try:
                function = self._function
                if function is None:
                    function = self._function = _loaded(self.spec, self._kernel, index).handle
                (err,) = _driver.cuLaunchKernel(function, self.grid, 1, 1, BLOCK, 1, 1, 0, stream.cuda_stream,
                                                self._params_address, 0)
            except (AttributeError, ImportError, TypeError) as e:  # these bindings differ: use the next path
                _give_up("driver", e)
                mode = launch_mode()
            else:
                if err != _driver.CUresult.CUDA_SUCCESS:  # a CUDA error (maybe an earlier kernel's): report it
                    raise RuntimeError(f"CUDA error launching the {self.spec.name} pack kernel: {err}")
                return
        if mode == "core":
            try:
                _launch_core(self, stream, index)
                return
            except (AttributeError, ImportError, TypeError, StopIteration) as e:
                _give_up("core", e)
        handle = stream.cuda_stream
        configured = _numba_configs.get((self.spec.name, self.grid, handle))
        if configured is None:
            configured = _configure_numba(self.spec, self._kernel, self.grid, handle)
        configured(*self._np_args)


def _loaded(spec: KernelSpec, kernel: Any, index: int) -> Any:
    """Numba's function object for ``kernel`` loaded on GPU ``index`` (as Numba's own launch finds it)."""
    function = _functions.get((spec.name, index))
    if function is None:
        overload = next(iter(kernel.overloads.values()))
        function = _functions[(spec.name, index)] = overload._codelibrary.get_cufunc()
    return function


def _launch_core(launch: Launch, stream: Any, index: int) -> None:
    if _core_launch is None:
        raise ImportError("cuda.core is not installed")
    core_kernel = _loaded(launch.spec, launch._kernel, index).kernel
    handle = stream.cuda_stream
    core_stream = _core_streams.get(handle)
    if core_stream is None:
        core_stream = _core_streams[handle] = _CoreStream.from_handle(handle)
    config = _core_configs.get(launch.grid)
    if config is None:
        config = _core_configs[launch.grid] = _LaunchConfig(grid=(launch.grid, 1, 1), block=(BLOCK, 1, 1),
                                                            shmem_size=0)
    _core_launch(core_stream, config, core_kernel, *launch._args)


def _configure_numba(spec: KernelSpec, kernel: Any, grid: int, handle: int) -> Any:
    nb_stream = _numba_streams.get(handle) if handle else 0
    if nb_stream is None:
        nb_stream = _numba_streams[handle] = cuda.external_stream(handle)
    with warnings.catch_warnings():  # small grids are deliberate here (few rows), not an occupancy bug
        warnings.simplefilter("ignore")
        configured = _numba_configs[(spec.name, grid, handle)] = kernel[grid, BLOCK, nb_stream]
    return configured


def _ensure_context(index: int) -> None:
    """Make sure a CUDA context is current in this thread before the first driver-level launch.

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
    devices = getattr(_thread, "devices", None)
    if devices is None:
        devices = _thread.devices = set()
    devices.add(index)


def _give_up(mode: str, error: BaseException) -> None:
    _broken.add(mode)
    _modes.clear()
    log.warning("gpucomm: the %r kernel launch path does not work with this numba-cuda/cuda-python (%s: %s); "
                "using the %r path (a few microseconds more per launch).", mode, type(error).__name__, error,
                launch_mode())
