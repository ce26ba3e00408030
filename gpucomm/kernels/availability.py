"""Whether this process packs CUDA buckets with the Numba kernels or with torch ops: decided once.

The first CUDA bucket copy tries the kernels. If they cannot run here (numba-cuda missing or
broken, no usable driver or toolkit, a compile failure), that is settled for the life of the
process: one warning names the cause and the fix, ``kernel_fallbacks`` in ``gpucomm.stats()``
counts the decision (once), and every later copy goes straight to torch ops, with no further
compile attempt and no exception raised and caught per call. Imports no numba.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..counters import COUNTERS
from ..errors import KernelUnavailableError

__all__ = ["kernels_usable", "give_up", "status", "note_success", "reset", "try_kernels"]

log = logging.getLogger("gpucomm.kernels")

_lock = threading.Lock()
_state: dict[str, Any] = {"usable": True, "decided": False, "reason": "", "fallback_copies": 0}


def kernels_usable() -> bool:
    """False once the kernels were found unusable in this process (a dict lookup)."""
    return _state["usable"]


def note_success() -> None:
    """A kernel copy ran: the kernels are settled as usable."""
    if not _state["decided"]:
        _state["decided"] = True


def give_up(error: BaseException) -> None:
    """Settle on the torch-ops fallback for the rest of the process; warn and count once."""
    with _lock:
        if not _state["usable"]:
            return
        _state.update(usable=False, decided=True, reason=f"{type(error).__name__}: {error}")
        COUNTERS.kernel_fallbacks += 1
    log.warning(
        "gpucomm: the fusion kernels cannot run in this process, so every CUDA bucket is packed and unpacked with "
        "torch ops from now on (a few launches per bucket instead of one; same results). Cause: %s. Fix: see the "
        "cause; `gpucomm-run --check-build` checks the CUDA Python stack, and GPUCOMM_FUSION_KERNELS=0 "
        "chooses torch ops without trying the kernels.", _state["reason"])


def reset() -> None:
    """Forget the decision: the next CUDA copy tries the kernels again (tests, or a long-lived
    process whose CUDA installation was repaired; kernels that failed to compile stay failed)."""
    with _lock:
        _state.update(usable=True, decided=False, reason="", fallback_copies=0)


def try_kernels(copy: Callable[[], None]) -> bool:
    """Run ``copy`` (a kernel copy) unless the kernels were given up; False means: use torch ops.
    The first ``KernelUnavailableError`` (or a numba-cuda that does not import) gives them up for
    the process; argument errors propagate."""
    if not _state["usable"]:
        return False
    try:
        copy()
    except (KernelUnavailableError, ImportError) as e:
        give_up(e)
        return False
    note_success()
    return True


def count_fallback_copy() -> None:
    _state["fallback_copies"] += 1


def status() -> dict[str, Any]:
    """How CUDA buckets are copied in this process.

    ``decided``: a CUDA copy has run; ``usable``: the kernels are (still) used; ``reason``: why
    not; ``fallback_copies``: copies done with torch ops after giving up; ``numpy_shims``: NumPy
    names restored while numba-cuda loaded (``compat.py``; None before the first compile);
    ``compiled``: kernel variants compiled so far; ``launch``: the launch path in use."""
    from . import compat  # noqa: PLC0415 - imports numpy only

    out = dict(_state)
    out["numpy_shims"] = compat.applied_shims()
    out["compiled"], out["launch"] = _launch_facts()
    return out


def _launch_facts() -> tuple[list[str], str | None]:
    import sys  # noqa: PLC0415

    launch = sys.modules.get(f"{__package__}.launch")
    if launch is None:  # numba not imported yet: nothing compiled
        return [], None
    return sorted(launch.compiled_names()), launch.launch_mode()
