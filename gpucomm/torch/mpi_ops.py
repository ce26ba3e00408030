"""Horovod's module name for the collectives (``horovod.torch.mpi_ops``): scripts and libraries that
import from it keep working, the differentiable forms (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped forms, which Horovod defines in that module too)
included. gpucomm's own code uses ``collectives``, ``autograd`` and ``submission``."""

from __future__ import annotations

from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                       grouped_reducescatter, reducescatter)
from .collectives import *  # noqa: F403 - this module is an alias
from .collectives import __all__ as _collectives_names

__all__ = list(_collectives_names) + ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
                                      "grouped_allreduce", "grouped_reducescatter", "reducescatter"]
