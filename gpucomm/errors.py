"""Every exception gpucomm raises of its own, in one place, all under ``GpucommError`` (a
RuntimeError), with the builtin base Horovod users catch kept beside it where it matters
(``NotInitializedError`` and the configuration errors are also ValueErrors). The one exception is
``WorkerRemoved``, an exit (``SystemExit``), not an error. Each is importable from the module that
raises it, as before."""

from __future__ import annotations

from typing import Sequence


class GpucommError(RuntimeError):
    """Base class of gpucomm's own runtime errors."""


class NotInitializedError(GpucommError, ValueError):
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


class HostsUpdatedInterrupt(GpucommError):
    """Elastic training: the launcher's host set changed; ``hvd.elastic.run`` re-forms the job.

    ``skip_sync`` is True when hosts were only removed: every remaining rank already holds the
    committed state, so the state need not be broadcast again (Horovod's attribute)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed; re-forming the job (elastic mode)")
        self.skip_sync = skip_sync


# -- the bootstrap: world, devices, rendezvous store, framing, key exchange --------------------------


class WorldError(GpucommError, ValueError):
    """The environment describes an impossible or incomplete job."""


class SlurmSyntaxError(GpucommError, ValueError):
    """A Slurm variable that does not follow Slurm's notation."""


class DevicePinningError(GpucommError):
    """Raised when the local ranks cannot be given one GPU each."""


class RendezvousError(GpucommError):
    """The bootstrap store could not be reached or answered wrongly."""


class RendezvousAuthError(RendezvousError):
    """The server rejected our frames: the job secrets differ."""


class RendezvousUnreachable(RendezvousError):
    """No store answered at the address within the connect timeout (its process is not serving)."""


class RendezvousRefused(RendezvousError):
    """The store refused a request (too large, or it would exceed the store's byte cap); the
    message says which limit and how to change it."""


class RendezvousTimeout(RendezvousError):
    """A wait ran out; ``missing`` lists the keys that never appeared."""

    def __init__(self, message: str, missing: Sequence[str]) -> None:
        super().__init__(message)
        self.missing = list(missing)


class FrameError(GpucommError):
    """A frame broke the protocol (internal: the connection is closed). ``kind`` says how, for code that
    acts on it: ``"mac"`` (signed with another secret), ``"deadline"`` (not complete in time),
    ``"closed"`` (the peer hung up, ``got`` bytes into the piece), ``"deny"`` (the peer refused us) or
    ``"malformed"``."""

    def __init__(self, message: str, kind: str = "malformed", got: int = 0) -> None:
        super().__init__(message)
        self.kind, self.got = kind, got

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.kind, self.got)


class SealError(GpucommError, ValueError):
    """A sealed secret did not open: wrong key (the store was tampered with) or corrupt."""


# -- the control plane -------------------------------------------------------------------------------


class ControlError(GpucommError):
    """The control connection could not be set up or broke."""


class ProtocolError(GpucommError):
    """A rank sent something the coordinator cannot interpret (a bug, or mixed gpucomm versions)."""


# -- the MPI data plane ------------------------------------------------------------------------------


class MpiUnavailable(GpucommError):
    """mpi4py, or the MPI library it loads, cannot give gpucomm an MPI data plane here (the message
    says why and how to fix it, or to use Gloo)."""


# -- elastic rounds (the worker's side) --------------------------------------------------------------


class RoundReplaced(GpucommError):
    """The launcher published a newer round while this one was forming (a worker died or the hosts
    changed): the worker leaves it and joins the next one."""


# -- the launcher ------------------------------------------------------------------------------------


class HostSpecError(GpucommError, ValueError):
    """A ``-H`` list, hostfile or ``-np`` that cannot describe a job."""


class DiscoveryError(GpucommError):
    """The discovery script failed or printed something that is not a host list."""


class ElasticJobError(GpucommError):
    """The elastic job cannot go on (reason in the message)."""


class RunError(GpucommError):
    """A rank of a ``gpucomm.run`` job failed (a RuntimeError, as Horovod raises).

    ``rank``/``host``: the first rank to fail; ``exception``: its exception, when it could be
    brought back (also the ``__cause__``); ``remote_traceback``: its traceback as text;
    ``exit_code``: its exit status, when it died without raising."""

    def __init__(self, message: str, *, rank: int | None = None, host: str | None = None,
                 exception: BaseException | None = None, remote_traceback: str | None = None,
                 exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.host, self.exception = rank, host, exception
        self.remote_traceback, self.exit_code = remote_traceback, exit_code


class FitError(GpucommError, ValueError):
    """Measured (bytes, seconds) samples cannot give a meaningful alpha-beta line (``gpucomm.tuning``)."""


class MpiLaunchError(SystemExit):
    """``gpucomm-run --mpi`` cannot start the job (the message says why and what to do). An exit of
    the launcher, not an error of a job, like ``WorkerRemoved``."""

    def __init__(self, message: str) -> None:
        super().__init__(f"gpucomm-run --mpi: {message}")


class WorkerRemoved(SystemExit):
    """The launcher left this elastic worker out of the job (its host was removed or blacklisted, or
    the job has more workers than --max-np): the process ends with status 0. An exit, not an error
    (with ``MpiLaunchError``, the exceptions here not under ``GpucommError``)."""

    def __init__(self, worker: str, why: str) -> None:
        super().__init__(0)
        self.worker, self.why = worker, why

    def __str__(self) -> str:
        return f"gpucomm elastic: worker {self.worker} leaves the job: {self.why}"
