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


class NonFiniteGradientError(GpucommError, FloatingPointError):
    """A gradient went non-finite (NaN or Inf) on some rank (``DistributedOptimizer(check_finite=
    "raise")``); raised on every rank in the same step. ``findings`` names each rank and parameter."""

    def __init__(self, message: str, step: int, findings: list) -> None:
        super().__init__(message)
        self.step, self.findings = step, findings


class KernelUnavailableError(GpucommError):
    """gpucomm's Numba CUDA kernels cannot run in this process (no GPU, driver or toolkit)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: the launcher's host set changed; ``hvd.elastic.run`` re-forms the job.

    ``skip_sync`` is True when hosts were only removed: every remaining rank already holds the
    committed state, so the state need not be broadcast again (Horovod's attribute)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed; re-forming the job (elastic mode)")
        self.skip_sync = skip_sync
