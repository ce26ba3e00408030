"""Exception types shared by every layer."""

from __future__ import annotations


class GpucommError(RuntimeError):
    """Base class of gpucomm's own runtime errors."""


class NotInitializedError(ValueError):
    """A call needs ``init()`` first (a ValueError, as in Horovod)."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(f"gpucomm has not been initialized; use hvd.init() (needed by {what}).")


class CollectiveError(GpucommError):
    """A collective failed or timed out; raised by ``synchronize`` (Horovod's HorovodInternalError)."""


class ShutdownError(CollectiveError):
    """The operation was still pending when gpucomm shut down."""


class KernelUnavailableError(GpucommError):
    """gpucomm's Numba CUDA kernels cannot run in this process (no GPU, driver or toolkit)."""
