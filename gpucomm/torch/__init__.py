"""Horovod-compatible front: ``import gpucomm.torch as hvd``.

Importing it loads torch and the collectives' front end only; ``hvd.init()`` loads the job's
machinery, and ``DistributedOptimizer``, the broadcast helpers and checkpoints load on first use.
"""

from __future__ import annotations

import importlib.util

from ..lazy import lazy_dir, lazy_names
from ..counters import stats
from ..errors import CollectiveError as HorovodInternalError
from ..errors import HostsUpdatedInterrupt
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                       grouped_reducescatter, reducescatter)
from . import adasum as _adasum  # noqa: F401 - registers how an Adasum allreduce starts
from .compression import Compression
from .collectives import (Adasum, Average, Max, Min, Product, Sum, add_process_set, allgather_async, allreduce_,
                          allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async,
                          broadcast_async_, grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                          grouped_allreduce_async_, grouped_reducescatter_async, join, poll, reducescatter_async,
                          remove_process_set, synchronize)
from ..process_sets import ProcessSet, global_process_set
from .submission import current_job, init_job, job_initialized, shutdown_job

_LAZY = {"DistributedOptimizer": "optimizer", "ZeroRedundancyOptimizer": "optimizer", "save_checkpoint": "checkpoint", "allgather_object": "functions",
         "broadcast_object": "functions", "broadcast_optimizer_state": "functions",
         "broadcast_parameters": "functions", "SyncBatchNorm": "sync_batch_norm",
         "sparse_allreduce_async": "collectives", "elastic": "elastic"}


__getattr__ = lazy_names(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())


def _nccl_version() -> int:
    from ..backends.nccl import nccl_version  # noqa: PLC0415 - loads CuPy when asked

    return nccl_version()


def init(comm=None, process_sets=None) -> None:
    """Join the job the launcher described (gpucomm-run, torchrun, Slurm, mpirun, or none: one process).

    ``process_sets``: ``ProcessSet``s to register now (the same list on every rank), or
    ``"dynamic"`` to allow ``add_process_set``/``remove_process_set`` later."""
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) (a sub-world or an mpi4py communicator) is not supported by "
                                  "gpucomm; start exactly the processes that should take part.")
    sets = list(process_sets) if process_sets is not None and not isinstance(process_sets, str) else []
    for ps in sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"init(process_sets=...) takes hvd.ProcessSet objects, got {type(ps).__name__}.")
    if job_initialized():
        init_job()
        return
    job = init_job(process_sets)
    global_process_set.register(0, range(job.world.size), job.world.rank)
    for set_id, ps in enumerate(sets, start=1):
        ps.register(set_id, ps.ranks, job.world.rank)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Horovod-format timeline (Chrome trace JSON) to ``file_path`` on rank 0."""
    _job().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and close its file (valid JSON)."""
    _job().stop_timeline()


def shutdown() -> None:
    """Leave the job; outstanding operations fail. ``init()`` may be called again afterwards."""
    shutdown_job()


def is_initialized() -> bool:
    """Whether ``init()`` has run in this process (and ``shutdown()`` has not since)."""
    return job_initialized()


def _job():
    """The initialized job (the world, hosts and timeline live there)."""
    return current_job()  # NotInitializedError is a ValueError, as Horovod raises


def size() -> int:
    """Number of processes in the job."""
    return _job().world.size


def rank() -> int:
    """This process's index in the job."""
    return _job().world.rank


def local_size() -> int:
    """Number of processes on this host."""
    return _job().world.local_size


def local_rank() -> int:
    """This process's index on its host (pick the GPU with it)."""
    return _job().world.local_rank


def cross_size() -> int:
    """Number of processes with this process's local rank (one per host in homogeneous jobs)."""
    return _job().cross_size


def cross_rank() -> int:
    """This process's index among those with its local rank (its host's index, usually)."""
    return _job().cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks (Horovod's ``is_homogeneous``)."""
    counts: dict[str, int] = {}
    for host in _job().hosts:
        counts[host] = counts.get(host, 0) + 1
    return len(set(counts.values())) == 1


def nccl_built() -> int:
    """NCCL's version code (e.g. 23203), or 0 when CuPy's NCCL cannot be loaded. Callable before init."""
    return _nccl_version()


def gloo_built() -> bool:
    """Whether torch has Gloo, which carries CPU collectives (when they are not on MPI). Callable before init."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def mpi_built() -> bool:
    """Whether CPU collectives can run on MPI here: mpi4py is installed (``pip install "gpucomm[mpi]"``).
    Callable before init; imports nothing (MPI is initialized only by a job that uses it)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """Whether this job's CPU collectives run on Gloo (every initialized job but one on MPI)."""
    return job_initialized() and not current_job().on_mpi


def mpi_enabled() -> bool:
    """Whether this job's CPU collectives run on MPI (an MPI launcher with mpi4py, or
    ``GPUCOMM_CPU_OPERATIONS=mpi``); GPU tensors use NCCL either way."""
    return job_initialized() and current_job().on_mpi


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced: CuPy's NCCL loads (``nccl_built()`` gives its version). Callable
    before init."""
    return _nccl_version() > 0


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """True in a job on MPI: gpucomm's MPI data plane runs only at ``MPI_THREAD_MULTIPLE`` (init
    checks it). Raises ``ValueError``, as Horovod does, when the job's CPU collectives are not on MPI."""
    if not mpi_enabled():
        raise ValueError("MPI is not enabled in this job: its CPU collectives run on Gloo (or it is not initialized). "
                         "They run on MPI under an MPI launcher (gpucomm-run --mpi, mpirun, mpiexec) with mpi4py "
                         "installed, or with GPUCOMM_CPU_OPERATIONS=mpi; check hvd.mpi_enabled() first.")
    return True
