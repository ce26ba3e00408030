"""gpucomm: a pure-Python data-parallel training communicator (NCCL through CuPy, Gloo on CPU).

``import gpucomm`` is light (no torch, CuPy or Numba): the names below load their modules on first
use. The Horovod-style front is ``import gpucomm.torch as hvd``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CollectiveError, GpucommError, NotInitializedError, ShutdownError
from .reduce_op import ReduceOp

__version__ = "0.1.0"

_LAZY = {"Communicator": "communicator", "stats": "counters"}

__all__ = ["Communicator", "CollectiveError", "GpucommError", "NotInitializedError", "ReduceOp", "ShutdownError", "stats",
           "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
