"""Lets numba-cuda 0.30.x build kernels on a NumPy newer than it knows (NumPy 2.5 and later).

Why this exists: when numba-cuda's CUDA target first loads its registries (on the first compile,
``numba/cuda/np/arrayobj.py``), it registers an overload for ``np.row_stack``. NumPy 2.5 removed
``row_stack``, so that module fails with ``AttributeError: module 'numpy' has no attribute
'row_stack'`` and *every* kernel compile fails. numba-cuda is in maintenance mode and will not be
fixed upstream (NVIDIA/numba-cuda #902, #907). numba itself (the CPU target) already guards the name.

The fix is narrow and temporary: only when a name in ``REMOVED_NUMPY_NAMES`` is missing, a stand-in
is put on ``numpy`` while numba-cuda's target contexts load their registries, and removed again
right after, so NumPy's namespace is unchanged for every other library. The stand-in is a distinct
function (never ``np.vstack`` itself), so numba-cuda's overload attaches to an object nobody calls
and nothing of ``vstack`` changes. On NumPy < 2.5 nothing is done.

``GPUCOMM_NUMBA_COMPAT=0`` turns the shim off (to see numba-cuda's own failure).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import numpy as np

from ..settings import NUMBA_COMPAT

__all__ = ["REMOVED_NUMPY_NAMES", "prepare_numba_cuda", "applied_shims"]

# NumPy name -> what it was an alias of (for the stand-in's docstring); extend as NumPy removes more
REMOVED_NUMPY_NAMES: dict[str, str] = {"row_stack": "vstack"}

_lock = threading.Lock()
_state: dict[str, tuple[str, ...]] = {}  # "applied" -> shims used while the registries loaded
_stand_ins: dict[str, Callable] = {}  # kept alive: numba keeps only weak references to overloaded globals


def _stand_in(name: str, alias_of: str) -> Callable:
    target = getattr(np, alias_of)

    def stand_in(*args, **kwargs):
        return target(*args, **kwargs)

    stand_in.__name__ = name
    stand_in.__doc__ = f"gpucomm stand-in for numpy.{name} (removed from NumPy), used only while numba-cuda loads."
    return stand_in


def prepare_numba_cuda() -> tuple[str, ...]:
    """Load numba-cuda's CUDA target registries now, with any removed NumPy names briefly restored.

    Call before compiling (idempotent, thread-safe, cheap after the first call). Returns the names
    that had to be shimmed (empty on NumPy versions numba-cuda supports). Does nothing in the
    simulator, which does not use the CUDA target."""
    applied = _state.get("applied")
    if applied is not None:
        return applied
    with _lock:
        if "applied" in _state:
            return _state["applied"]
        missing = tuple(n for n in REMOVED_NUMPY_NAMES if not hasattr(np, n))
        enabled = NUMBA_COMPAT.read(None, True)
        if not missing or not enabled or _simulator():
            _state["applied"] = ()
            return ()
        for name in missing:
            _stand_ins[name] = _stand_in(name, REMOVED_NUMPY_NAMES[name])
            setattr(np, name, _stand_ins[name])
        try:
            from numba.cuda.descriptor import cuda_target  # noqa: PLC0415

            cuda_target.target_context.refresh()  # imports numba.cuda.np.* and installs their registries
        finally:
            for name in missing:
                if getattr(np, name, None) is _stand_ins[name]:
                    delattr(np, name)
        _state["applied"] = missing
        return missing


def applied_shims() -> tuple[str, ...] | None:
    """The names shimmed so far (None: numba-cuda's registries were not prepared yet)."""
    return _state.get("applied")


def _simulator() -> bool:
    if "numba" in sys.modules:
        from numba.cuda.core import config  # noqa: PLC0415

        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() == "1"
