"""Horovod's module name for the collectives (``horovod.torch.mpi_ops``): scripts and libraries that
import from it keep working. gpucomm's own code uses ``collectives`` and ``submission``."""

from __future__ import annotations

from .collectives import *  # noqa: F403 - this module is an alias
from .collectives import __all__ as _collectives_names

__all__ = list(_collectives_names)
