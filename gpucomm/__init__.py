"""gpucomm: a pure-Python data-parallel training communicator (NCCL through CuPy, Gloo on CPU).

``import gpucomm`` is light (no torch, CuPy or Numba): the names below load their modules on first
use. The Horovod-style front is ``import gpucomm.torch as hvd``; ``gpucomm.run(func, num_proc=N)``
is ``horovod.run``.
"""

from __future__ import annotations

from .errors import CollectiveError, GpucommError, NotInitializedError, ShutdownError
from .lazy import lazy_dir, lazy_names
from .reduce_op import ReduceOp

__version__ = "0.1.0"

_LAZY = {"Communicator": "communicator", "stats": "counters", "run": "runner.programmatic"}

__all__ = ["Communicator", "CollectiveError", "GpucommError", "NotInitializedError", "ReduceOp", "ShutdownError", "run",
           "stats", "__version__"]


__getattr__ = lazy_names(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
