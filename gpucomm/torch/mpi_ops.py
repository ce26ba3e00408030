"""Horovod's module name for the collectives (``horovod.torch.mpi_ops``): scripts and libraries that
import from it keep working, the differentiable forms (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped forms, which Horovod defines in that module too)
included, and the job's basics Horovod keeps there (``init``, ``rank``, ``local_size``, the ``*_built`` and
``*_enabled`` checks, ``ProcessSet``, ``HorovodInternalError``, ``Compression``), its autograd classes
(``HorovodAllreduce`` and the like, with Horovod's ``apply`` signatures) and the four helpers Horovod's
module imports from ``horovod.common.util``. gpucomm's own code uses ``collectives``, ``autograd`` and
``submission``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .autograd import (HorovodAllgather, HorovodAllreduce, HorovodAlltoall, HorovodBroadcast, HorovodGroupedAllgather,
                       HorovodGroupedAllreduce, HorovodGroupedReducescatter, HorovodReducescatter, allgather, allreduce,
                       alltoall, broadcast, grouped_allgather, grouped_allreduce, grouped_reducescatter, reducescatter)
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

AUTOGRAD_CLASSES = ["HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall", "HorovodBroadcast",
                    "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter",
                    "HorovodReducescatter"]


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Horovod's check before an Adasum allreduce)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``ext_base_name`` (``"horovod.torch"`` in Horovod's scripts) can run on GPUs here: for
    gpucomm, a CUDA device torch can use and NCCL (any other framework name: False)."""
    available = ext_base_name.rsplit(".", 1)[-1] in ("torch", "gpucomm") and torch.cuda.is_available() \
        and nccl_built() > 0
    if verbose and not available:
        print(f"{ext_base_name}: not running with GPU (torch.cuda.is_available()={torch.cuda.is_available()}, "
              f"NCCL {'found' if nccl_built() else 'not found'})")
    return bool(available)


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, bool | None], Any]:
    """Horovod's rule for the deprecated ``average=`` flag, as a function of ``(op, average)`` giving
    ``reduce_ops.Average``/``reduce_ops.Sum`` (an object with those attributes, as Horovod's basics)."""
    def handle(op: Any, average: bool | None) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return handle


def check_installed_version(name: str, version: str, exception: BaseException | None = None) -> None:
    """Horovod warns (or raises from ``exception``) when a framework's installed version differs from
    the one its extension was compiled against. gpucomm compiles nothing against a framework, so no
    installed version can mismatch: this checks only that ``name`` is installed at all."""
    from importlib.metadata import PackageNotFoundError, version as installed  # noqa: PLC0415

    try:
        installed(name)
    except PackageNotFoundError:
        message = f"{name} is not installed (gpucomm was asked about version {version}); install it with pip"
        if exception is not None:
            raise ImportError(message) from exception
        import warnings  # noqa: PLC0415

        warnings.warn(message, stacklevel=2)


HELPERS = ["check_installed_version", "get_average_backwards_compatibility_fun", "gpu_available",
           "num_rank_is_power_2"]

__all__ = list(_collectives_names) + ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
                                      "grouped_allreduce", "grouped_reducescatter", "reducescatter"] + BASICS + AUTOGRAD_CLASSES + HELPERS
