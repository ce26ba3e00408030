"""Loading MPI for gpucomm's MPI backend (``mpi.py``): which MPI library mpi4py loads, initializing it
with ``MPI_THREAD_MULTIPLE`` only under its own launcher, the factory communicator that creates every
gpucomm communicator, and the exit hook that calls ``MPI_Abort`` when a collective is still stuck
at exit (so the launcher stops every rank instead of the job hanging in ``MPI_Finalize``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from importlib.util import find_spec
from typing import Any, Mapping

from ..bootstrap.launch_env import mpi_launcher
from ..errors import MpiUnavailable

EXIT_GRACE_S = 10.0  # at exit, how long a collective still running may take before MPI_Abort
INSTALL_HINT = 'pip install "gpucomm[mpi]" brings mpi4py and MPICH from PyPI, no system MPI needed'


def library_family(version: str) -> str:
    """The family of an MPI library from ``MPI_Get_library_version``'s text: openmpi, mpich or other."""
    if "Open MPI" in version:
        return "openmpi"
    if any(name in version for name in ("MPICH", "Intel(R) MPI", "MVAPICH")):
        return "mpich"
    return "other"


def mpi4py_installed() -> bool:
    """Whether mpi4py can be imported (without importing it)."""
    return find_spec("mpi4py") is not None


_init_lock = threading.Lock()
_factory_comm: Any = None  # a private duplicate of COMM_WORLD that only creates communicators
# every live MPI backend (``mpi.MpiBackend`` adds itself): the exit hook asks them what is still in MPI
LIVE_BACKENDS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_exit_hook_installed = False


def _thread_level_name(MPI: Any, level: int) -> str:
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    return names.get(level, str(level))


def load_mpi(env: Mapping[str, str] | None = None) -> Any:
    """mpi4py's ``MPI`` module, initialized with ``MPI_THREAD_MULTIPLE``; raises ``MpiUnavailable``
    saying why not and what to do.

    When this call is the first to import ``mpi4py.MPI``, MPI's library is loaded first and
    initialized only if it belongs to the launcher that started the process (MPICH's library
    aborts the process in ``MPI_Init`` under Open MPI's ``mpirun``). If the program initialized MPI
    itself, its thread level is checked instead."""
    env = os.environ if env is None else env
    with _init_lock:
        try:
            import mpi4py  # noqa: PLC0415 - optional dependency, imported only when MPI is wanted
        except ImportError:
            raise MpiUnavailable(f"mpi4py is not installed, so gpucomm cannot use MPI; {INSTALL_HINT}, or use "
                                 f"Gloo (GPUCOMM_CPU_OPERATIONS=gloo).") from None
        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # checked below before MPI_Init can abort the process
            mpi4py.rc.finalize = True  # ... and still finalized at exit, after our own exit hook
        try:
            from mpi4py import MPI  # noqa: PLC0415
        except (ImportError, RuntimeError, OSError) as e:
            raise MpiUnavailable(f"mpi4py is installed but could not load an MPI library ({e}); {INSTALL_HINT}, or "
                                 f"point mpi4py at one with MPI4PY_LIBMPI=/path/to/libmpi.so.") from None
        if MPI.Is_finalized():
            raise MpiUnavailable("MPI was already finalized in this process (MPI_Finalize was called); it cannot be "
                                 "initialized again. Call gpucomm's init() before finalizing MPI, or use Gloo.")
        version = MPI.Get_library_version().strip().splitlines()[0]
        if not MPI.Is_initialized():
            launcher, library = mpi_launcher(env), library_family(version)
            if launcher is not None and library != "other" and launcher != library:
                raise MpiUnavailable(_mismatch(launcher, library, version))
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_MULTIPLE:
            raise MpiUnavailable(
                f"MPI runs at thread level {_thread_level_name(MPI, provided)} in this process ({version}), but "
                f"gpucomm's MPI data plane needs MPI_THREAD_MULTIPLE: each communicator makes its MPI calls on "
                f"its own thread, and two of them may be inside MPI at once. Likely causes: the program imported "
                f"mpi4py with mpi4py.rc.thread_level set lower, or called MPI_Init itself, before gpucomm's init(); "
                f"or this MPI library was built without thread support. Fix: leave mpi4py.rc.thread_level at its "
                f"default ('multiple'), use an MPI built with threads ({INSTALL_HINT}), or use Gloo "
                f"(GPUCOMM_CPU_OPERATIONS=gloo).")
        _install_exit_hook()
        return MPI


def _mismatch(launcher: str, library: str, version: str) -> str:
    names = {"openmpi": "Open MPI", "mpich": "MPICH"}
    if launcher == "openmpi":
        fix = ("launch with MPICH's mpiexec instead (`gpucomm-run --mpi` picks the one beside this Python), or make "
               "mpi4py load Open MPI's library: export MPI4PY_MPIABI=openmpi and pass it with `mpirun -x "
               "MPI4PY_MPIABI` (launch/mpirun.sh does this)")
    else:
        fix = ("launch with Open MPI's mpirun instead, or make mpi4py load an MPICH library (unset MPI4PY_MPIABI / "
               "MPI4PY_LIBMPI, or pip install mpich)")
    return (f"this process was started by {names[launcher]}'s launcher, but mpi4py loads {names[library]}'s library "
            f"({version}); an MPI library only runs under its own launcher (MPICH aborts in MPI_Init under Open "
            f"MPI's). Fix: {fix}; or use Gloo (GPUCOMM_CPU_OPERATIONS=gloo).")


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if not _exit_hook_installed:
        atexit.register(_abort_if_stuck)  # Python's atexit hooks run before mpi4py's MPI_Finalize
        _exit_hook_installed = True


def _abort_if_stuck() -> None:
    """At exit: a collective still inside MPI (a peer stopped, or it timed out) would make
    ``MPI_Finalize`` hang; wait briefly, then ``MPI_Abort`` so the launcher stops every rank."""
    backends = [b for b in list(LIVE_BACKENDS) if b.in_flight() is not None or b.broken() is not None]
    if not backends:
        return
    deadline = time.monotonic() + EXIT_GRACE_S
    while time.monotonic() < deadline and any(b.in_flight() is not None for b in backends):
        if all(b.broken() is not None for b in backends if b.in_flight() is not None):
            break  # already timed out once: waiting longer will not help
        time.sleep(0.05)
    stuck = [(b, b.in_flight()) for b in backends if b.in_flight() is not None]
    if not stuck:
        return
    from mpi4py import MPI  # noqa: PLC0415 - loaded already (a backend exists)

    what = "; ".join(f"{w} on communicator '{b.label}'" for b, w in stuck)
    sys.stderr.write(f"gpucomm: exiting while MPI calls are still in progress ({what}): a peer rank stopped or "
                     f"died, or the ranks issued collectives in different orders. Calling MPI_Abort so that the MPI "
                     f"launcher stops every rank instead of this process hanging in MPI_Finalize.\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def factory_comm(MPI: Any) -> Any:
    """This process's private duplicate of ``MPI_COMM_WORLD``, used only to create communicators
    (never for data, so creating one never races a collective). Made once, by the first
    ``mpi_world`` call, which every rank makes at the same point (init)."""
    global _factory_comm
    with _init_lock:
        if _factory_comm is None:
            _factory_comm = MPI.COMM_WORLD.Dup()
            _factory_comm.Set_name("gpucomm:factory")
        return _factory_comm


__all__ = ["EXIT_GRACE_S", "INSTALL_HINT", "LIVE_BACKENDS", "factory_comm", "library_family", "load_mpi",
           "mpi4py_installed"]
