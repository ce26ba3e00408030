"""Horovod's module name for the collectives (``horovod.torch.mpi_ops``): scripts and libraries that
import from it keep working, the differentiable forms (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped forms, which Horovod defines in that module too)
included, and the job's basics Horovod keeps there (``init``, ``rank``, ``local_size``, the ``*_built`` and
``*_enabled`` checks, ``ProcessSet``, ``HorovodInternalError``, ``Compression``). gpucomm's own code uses
``collectives``, ``autograd`` and ``submission``. Horovod's autograd classes (``HorovodAllreduce`` and the
like) are not exported: their ``apply`` signatures are Horovod's internals; use the functions."""

from __future__ import annotations

from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                       grouped_reducescatter, reducescatter)
from .collectives import *  # noqa: F403 - this module is an alias
from .collectives import __all__ as _collectives_names
from .compression import Compression
from ..errors import CollectiveError as HorovodInternalError
from ..process_sets import ProcessSet, global_process_set
# Horovod's mpi_ops also holds the job's basics; here the package defines them (loaded before this module)
from . import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
               is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
               nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)

BASICS = ["ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
          "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
          "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline",
          "stop_timeline", "Compression", "HorovodInternalError", "ProcessSet", "global_process_set"]

__all__ = list(_collectives_names) + ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
                                      "grouped_allreduce", "grouped_reducescatter", "reducescatter"] + BASICS
