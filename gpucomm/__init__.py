"""gpucomm: a pure-Python data-parallel training communicator (NCCL through CuPy, Gloo on CPU)."""

from .errors import CollectiveError, GpucommError, NotInitializedError, ShutdownError
from .ops import ReduceOp
from .communicator import Communicator

__version__ = "0.1.0"

__all__ = ["Communicator", "CollectiveError", "GpucommError", "NotInitializedError", "ReduceOp", "ShutdownError", "__version__"]
