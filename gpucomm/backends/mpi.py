"""CPU backend on MPI through mpi4py: collectives on CPU tensors' own memory (no copies), with the
shape of ``GlooBackend`` (``base.Backend``).

Why it exists: on one host MPI moves bytes through shared memory where Gloo goes through TCP
loopback (``benchmarks/mpi_vs_gloo.py`` measures both in one run).

Threads. Each ``MpiBackend`` owns one communicator and one worker thread; every MPI call on that
communicator (collectives, and finally ``MPI_Comm_free``) is made by that thread, in the order the
calls were issued. Issuing (any thread: the control thread, user threads, autograd hooks) only puts
a closure on the backend's queue under a lock and returns an ``MpiWork``; MPI's rule that
collectives on one communicator are called in the same order on every rank is then the caller's
order, exactly as for a Gloo group. Two backends (the fixed schedule's and the ad-hoc one, or two
process sets) progress independently on their own threads, so one may block in a collective while
the other completes: the ranks may interleave them differently. That needs
``MPI_THREAD_MULTIPLE``, which ``load_mpi`` requests and checks. The calls are MPI's blocking
collectives, not ``MPI_I*`` ones: blocking calls progress by themselves (nonblocking ones progress
only while something polls them), and measured here Open MPI 4.1's ``MPI_Iallreduce`` of 32 MiB on
2 ranks took 14x its ``MPI_Allreduce`` (558 vs 40 ms).

Failure. MPI cannot cancel a collective. ``MpiWork.wait`` gives up after its timeout (or as soon as
``failed()`` reports the job failed elsewhere) and raises ``CollectiveError`` naming the operation;
the backend is then broken: new calls on it fail at once. A process that exits while one of its
MPI calls is still stuck (or after such a timeout) calls ``MPI_Abort`` from an ``atexit`` hook
(which runs before mpi4py's ``MPI_Finalize``), so the MPI launcher stops every rank with that
message instead of the job hanging in ``MPI_Finalize``. A peer that dies is normally seen first by
the launcher (``mpiexec`` and ``mpirun`` stop the whole job when a rank exits abnormally).

Reductions. Integer and float32/64 types reduce with MPI's own types and operations (int8/uint8 as
``MPI_INT8_T``/``MPI_UINT8_T``: sums wrap around modulo 256, as in torch and Gloo). MPI has no
float16 or bfloat16: they travel as 2-byte ``MPI_UINT16_T`` elements and reduce through a
user-defined, commutative ``MPI_Op`` whose function applies torch's own kernel to the two buffers
(``torch.frombuffer`` views, no copy): each pairwise step rounds to the half type, as Gloo and NCCL
do, and the wire carries 2 bytes per element. ``BackendOp.AVG`` is a sum followed by a division of the
result (floating types only). Data movement (allgather, broadcast, alltoall) sends elements of the
dtype's size, so any fixed-size dtype moves, bool and bfloat16 included.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
import zlib
from importlib.util import find_spec
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import CollectiveError, MpiUnavailable
from .base import BackendOp

log = logging.getLogger("gpucomm")

POLL_S = 0.2  # how often a wait with a ``failed`` callback asks whether the job failed elsewhere
EXIT_GRACE_S = 10.0  # at exit, how long a collective still running may take before MPI_Abort
INSTALL_HINT = 'pip install "gpucomm[mpi]" brings mpi4py and MPICH from PyPI, no system MPI needed'

# The launchers' own variables: which MPI started this process (None: none did).
OPENMPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
MPICH_MARKERS = ("PMI_SIZE", "PMI_RANK")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")


# ---------------------------------------------------------------------------------------------
# the library


def launcher_family(env: Mapping[str, str]) -> str | None:
    """``"openmpi"`` or ``"mpich"`` when an MPI launcher started this process (its variables are
    set), else None. Intel MPI and MVAPICH use MPICH's launcher protocol (PMI) and count as MPICH."""
    if any(v in env for v in OPENMPI_MARKERS):
        return "openmpi"
    if any(v in env for v in MPICH_MARKERS):
        return "mpich"
    return None


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
_live: "weakref.WeakSet[MpiBackend]" = weakref.WeakSet()
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
            launcher, library = launcher_family(env), library_family(version)
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
    backends = [b for b in list(_live) if b.in_flight() is not None or b.broken() is not None]
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


# ---------------------------------------------------------------------------------------------
# types and operations


def _buf(MPI: Any, t: torch.Tensor) -> Any:
    """The tensor's own memory as an MPI buffer (no copy)."""
    return MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


_HALF = (torch.float16, torch.bfloat16)
_half_ops: dict[tuple[torch.dtype, BackendOp], Any] = {}
_types_lock = threading.Lock()
_move_types: dict[int, Any] = {}


_reduce_types: dict[torch.dtype, Any] = {}


def _reduce_type(MPI: Any, dtype: torch.dtype) -> Any:
    found = _reduce_types.get(dtype)
    if found is not None:
        return found
    table = {torch.uint8: MPI.UINT8_T, torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T,
             torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.float32: MPI.FLOAT,
             torch.float64: MPI.DOUBLE, torch.float16: MPI.UINT16_T, torch.bfloat16: MPI.UINT16_T}
    for name in ("uint16", "uint32", "uint64"):  # torch >= 2.3
        dt = getattr(torch, name, None)
        if dt is not None:
            table[dt] = getattr(MPI, name.upper() + "_T")
    _reduce_types.update(table)
    mpi_type = table.get(dtype)
    if mpi_type is None:
        raise ValueError(f"the MPI backend cannot reduce {dtype}: it reduces uint8, int8, int16, int32, int64, float16, "
                         f"bfloat16, float32 and float64 (the op layer validates this first; reaching here is a bug).")
    return mpi_type


def _half_op(MPI: Any, dtype: torch.dtype, op: BackendOp) -> Any:
    """A user-defined MPI reduction for a half type: torch's kernel on the two buffers."""
    key = (dtype, op)
    with _types_lock:
        found = _half_ops.get(key)
        if found is None:
            combine: Callable[[torch.Tensor, torch.Tensor], Any] = {
                BackendOp.SUM: lambda acc, x: acc.add_(x), BackendOp.AVG: lambda acc, x: acc.add_(x),
                BackendOp.PRODUCT: lambda acc, x: acc.mul_(x),
                BackendOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
                BackendOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc)}[op]

            def reduce(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
                if len(inoutbuf) == 0:
                    return
                combine(torch.frombuffer(inoutbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

            found = _half_ops[key] = MPI.Op.Create(reduce, commute=True)
        return found


def _reduce_op(MPI: Any, op: BackendOp) -> Any:
    return {BackendOp.SUM: MPI.SUM, BackendOp.AVG: MPI.SUM, BackendOp.MIN: MPI.MIN, BackendOp.MAX: MPI.MAX,
            BackendOp.PRODUCT: MPI.PROD}[op]


def _move_type(MPI: Any, itemsize: int) -> Any:
    """An MPI type of ``itemsize`` bytes to move elements of that size (counts stay in elements)."""
    known = {1: MPI.BYTE, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}
    if itemsize in known:
        return known[itemsize]
    with _types_lock:
        t = _move_types.get(itemsize)
        if t is None:
            t = _move_types[itemsize] = MPI.BYTE.Create_contiguous(itemsize).Commit()
        return t


def _describe(kind: str, t: torch.Tensor, extra: str = "") -> str:
    return f"{kind} of {t.numel()} {str(t.dtype).replace('torch.', '')}{extra}"


# ---------------------------------------------------------------------------------------------
# work


class MpiWork:
    """One issued MPI operation behind gpucomm's ``Work`` protocol."""

    __slots__ = ("what", "_backend", "_done", "_error", "_future", "_lock")

    def __init__(self, what: str, backend: "MpiBackend") -> None:
        self.what, self._backend = what, backend
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Any = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the operation has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float, failed: Callable[[], object] | None = None) -> None:
        """Block until finished; raise ``CollectiveError`` if it failed, after ``timeout`` seconds,
        or as soon as ``failed()`` is truthy (the job failed elsewhere)."""
        if not self._done.is_set():
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if self._done.wait(max(0.0, min(POLL_S, left) if failed is not None else left)):
                    break
                if failed is not None:
                    cause = failed()
                    if cause:
                        raise CollectiveError(f"the job failed while this rank waited for MPI {self.what} on "
                                              f"communicator '{self._backend.label}': {cause}")
                if time.monotonic() >= deadline:
                    raise self._backend.timed_out(self, timeout)
        if self._error is not None:
            raise CollectiveError(f"MPI {self.what} on communicator '{self._backend.label}' failed: "
                                  f"{self._error}") from self._error

    def future(self) -> Any:
        """A ``torch.futures.Future`` completed with the work (the timeline times ops with it)."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done.is_set():
                    self._future.set_result(None)
            return self._future

    def finish(self, error: BaseException | None) -> None:
        """Called by the backend's worker thread when the operation ended."""
        self._error = error
        with self._lock:
            self._done.set()
            future = self._future
        if future is not None:
            future.set_result(None)


# ---------------------------------------------------------------------------------------------
# the backend


_STOP = object()


class MpiBackend:
    """Collectives on CPU tensors over one MPI communicator, made by one worker thread."""

    name = "mpi"

    def __init__(self, MPI: Any, comm: Any, *, label: str, timeout: float, world_ranks: Sequence[int]) -> None:
        self._MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.label, self.timeout, self.world_ranks = label, timeout, tuple(world_ranks)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: list[Any] = []
        self._closed = False
        self._broken: str | None = None
        self._running: MpiWork | None = None
        self._dups = 0
        self._thread = threading.Thread(target=self._serve, name=f"gpucomm-mpi-{label}", daemon=True)
        self._thread.start()
        _live.add(self)

    # -- state ----------------------------------------------------------------------------------
    def in_flight(self) -> str | None:
        """What the worker thread is inside MPI for, or has queued, right now (None: idle)."""
        running = self._running
        if running is not None:
            return running.what
        with self._lock:
            queued = [item[1].what for item in self._queue if item is not _STOP]
        return queued[0] + " (queued)" if queued else None

    def broken(self) -> str | None:
        """Why this communicator takes no more collectives (None while it is healthy)."""
        return self._broken

    def timed_out(self, work: MpiWork, timeout: float) -> CollectiveError:
        """A wait gave up on ``work``: the communicator is broken from now on; the error to raise."""
        reason = (f"MPI {work.what} on communicator '{self.label}' (world ranks {list(self.world_ranks)}) did not "
                  f"complete within {timeout:g} s (GPUCOMM_TIMEOUT)")
        with self._lock:
            if self._broken is None:
                self._broken = reason
        return CollectiveError(
            f"{reason}. Likely causes: a peer rank died, stalled or stopped issuing collectives, or the ranks issued "
            f"collectives on this communicator in different orders. MPI cannot cancel a collective, so this "
            f"communicator takes no more work, and when this process exits it calls MPI_Abort so that the launcher "
            f"stops every rank. Fix: find the rank that stopped (the launcher reports its exit first); raise "
            f"GPUCOMM_TIMEOUT if the step is just slow.")

    # -- issuing ------------------------------------------------------------------------------------
    def _issue(self, what: str, call: Callable[[], None], keep: tuple[torch.Tensor, ...] = ()) -> MpiWork:
        """Queue ``call`` for the worker; ``keep`` (the tensors whose memory it uses) stays
        referenced until it has run."""
        work = MpiWork(what, self)
        with self._lock:
            if self._broken is not None:
                raise CollectiveError(f"MPI {what} refused on communicator '{self.label}': it is broken since "
                                      f"{self._broken}; the job has failed and must be restarted.")
            if self._closed:
                raise CollectiveError(f"MPI {what} refused: communicator '{self.label}' was closed (its process set "
                                      f"was removed, its optimizer closed, or gpucomm shut down).")
            self._queue.append((call, work, keep))
            self._cond.notify()
        return work

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.pop(0)
            if item is _STOP:
                break
            call, work, keep = item  # type: ignore[misc]
            self._running = work
            try:
                call()
                error = None
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                error = e
            self._running = None
            if error is not None:
                with self._lock:
                    if self._broken is None:  # an MPI error leaves the communicator in an unknown state
                        self._broken = f"MPI {work.what} failed: {error}"
            del call, keep, item
            work.finish(error)
        try:
            self.comm.Free()
        except self._MPI.Exception as e:
            log.debug("MPI_Comm_free of %s: %s", self.label, e)

    # -- collectives ------------------------------------------------------------------------------
    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> MpiWork:
        MPI, n = self._MPI, recv.numel()
        if send.numel() != n or send.dtype != recv.dtype:
            raise ValueError(f"allreduce: send ({send.numel()} {send.dtype}) and recv ({n} {recv.dtype}) must match.")
        mpi_type, mpi_op = self._reduction(recv.dtype, op)
        if send.data_ptr() == recv.data_ptr():
            source: Any = MPI.IN_PLACE
        else:
            if _overlap(send, recv):
                send = send.clone()
            source = [_buf(MPI, send), n, mpi_type]
        target = [_buf(MPI, recv), n, mpi_type]
        comm, average, size = self.comm, op is BackendOp.AVG, self.size

        def call() -> None:
            comm.Allreduce(source, target, mpi_op)
            if average:
                recv.div_(size)

        return self._issue(_describe("allreduce", recv, f" ({op.value})"), call, (send, recv))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, recv_counts: Sequence[int] | None = None,
                  stream: int | None = None) -> MpiWork:
        """Every rank's ``send`` in rank order into ``recv``: equal parts, or ``recv_counts[r]``
        elements from rank ``r`` (allgatherv; gpucomm's executor pads to equal parts today)."""
        MPI, n, size = self._MPI, send.numel(), self.size
        counts = [n] * size if recv_counts is None else [int(c) for c in recv_counts]
        if len(counts) != size or counts[self.rank] != n or sum(counts) != recv.numel() or send.dtype != recv.dtype:
            raise ValueError(f"allgather: recv must hold every rank's part ({counts}, {recv.numel()} elements of "
                             f"{recv.dtype}) and this rank sends {n} {send.dtype}.")
        mtype = _move_type(MPI, recv.element_size())
        displs = [sum(counts[:r]) for r in range(size)]
        at = recv.data_ptr() + displs[self.rank] * recv.element_size()
        if n and send.data_ptr() == at:
            source: Any = MPI.IN_PLACE
        else:
            if _overlap(send, recv):
                send = send.clone()
            source = [_buf(MPI, send), n, mtype]
        comm = self.comm
        if recv_counts is None:
            target: Any = [_buf(MPI, recv), n, mtype]

            def call() -> None:
                comm.Allgather(source, target)
        else:
            target = [_buf(MPI, recv), (counts, displs), mtype]

            def call() -> None:
                comm.Allgatherv(source, target)

        return self._issue(_describe("allgather", recv), call, (send, recv))

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> MpiWork:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of this {self.size}-rank communicator.")
        if self.rank == root and send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        MPI, comm = self._MPI, self.comm
        target = [_buf(MPI, recv), recv.numel(), _move_type(MPI, recv.element_size())]

        def call() -> None:
            comm.Bcast(target, root)

        return self._issue(_describe("broadcast", recv, f" from rank {root}"), call, (recv,))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> MpiWork:
        """``send_counts[r]`` elements to rank ``r``, ``recv_counts[r]`` from it, in rank order."""
        MPI, size = self._MPI, self.size
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(sc) != size or len(rc) != size or sum(sc) > send.numel() or sum(rc) > recv.numel() \
                or send.dtype != recv.dtype:
            raise ValueError(f"alltoall: {size} send counts {sc} (of {send.numel()}) and receive counts {rc} (of "
                             f"{recv.numel()}) needed, one per rank, within the tensors, of one dtype.")
        mtype = _move_type(MPI, recv.element_size())
        sd, rd = [sum(sc[:r]) for r in range(size)], [sum(rc[:r]) for r in range(size)]
        if send.data_ptr() == recv.data_ptr() and sc == rc:
            source: Any = MPI.IN_PLACE
        else:
            if _overlap(send, recv):
                send = send.clone()
            source = [_buf(MPI, send), (sc, sd), mtype]
        target = [_buf(MPI, recv), (rc, rd), mtype]
        comm = self.comm

        def call() -> None:
            comm.Alltoallv(source, target)

        return self._issue(_describe("alltoall", send), call, (send, recv))

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> MpiWork:
        """Part ``r`` (``recv.numel()`` elements) of the reduction of every rank's ``send`` to rank ``r``."""
        MPI, n, size = self._MPI, recv.numel(), self.size
        if send.numel() != n * size or send.dtype != recv.dtype:
            raise ValueError(f"reducescatter: send must hold {size} parts of {n} {recv.dtype}, got {send.numel()} "
                             f"{send.dtype}.")
        mpi_type, mpi_op = self._reduction(recv.dtype, op)
        comm, average, rank = self.comm, op is BackendOp.AVG, self.rank
        if _overlap(send, recv) and recv.data_ptr() == send.data_ptr() + rank * n * send.element_size():
            # in place (recv is this rank's part of send): MPI leaves the result at the start of send
            whole = [_buf(MPI, send), n, mpi_type]

            def call() -> None:
                comm.Reduce_scatter_block(MPI.IN_PLACE, whole, mpi_op)
                if rank:
                    recv.copy_(send[:n])
                if average:
                    recv.div_(size)
        else:
            if _overlap(send, recv):
                send = send.clone()
            source, target = [_buf(MPI, send), n, mpi_type], [_buf(MPI, recv), n, mpi_type]

            def call() -> None:
                comm.Reduce_scatter_block(source, target, mpi_op)
                if average:
                    recv.div_(size)

        return self._issue(_describe("reducescatter", recv, f" ({op.value})"), call, (send, recv))

    def barrier(self) -> MpiWork:
        comm = self.comm
        return self._issue("barrier", lambda: comm.Barrier())

    def _reduction(self, dtype: torch.dtype, op: BackendOp) -> tuple[Any, Any]:
        MPI = self._MPI
        if op is BackendOp.AVG and not dtype.is_floating_point:
            raise ValueError(f"the MPI backend averages floating types only, not {dtype}; reduce with SUM and scale "
                             f"(gpucomm's op layer does this for hvd.Average).")
        mpi_type = _reduce_type(MPI, dtype)
        return mpi_type, (_half_op(MPI, dtype, op) if dtype in _HALF else _reduce_op(MPI, op))

    # -- communicators ----------------------------------------------------------------------------
    def dup(self, label: str | None = None) -> "MpiBackend":
        """An independent communicator over the same ranks, with its own worker thread (MPI's
        ``Comm_dup`` semantics, made with ``MPI_Comm_create_group`` on the factory communicator).
        Every member calls it with the same ``label`` (default: the n-th dup of this backend)."""
        self._dups += 1
        return _create(self._MPI, self.world_ranks, label or f"{self.label}/dup{self._dups}", self.timeout)

    def close(self, *, abort: bool = False) -> None:
        """Release the communicator: the worker finishes what was issued, frees it and ends.
        ``abort`` (the job failed): do not wait for it; a collective stuck in MPI stays stuck, and
        the exit hook aborts the MPI job if it still is at exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if abort and self._broken is None:
                self._broken = "the job failed and closed it"
            self._queue.append(_STOP)
            self._cond.notify()
        if not abort:
            self._thread.join(self.timeout)
            if self._thread.is_alive():
                log.warning("MPI communicator %s: %s still running %g s after close; leaving it to the exit hook",
                            self.label, self.in_flight(), self.timeout)


def _create(MPI: Any, world_ranks: Sequence[int], label: str, timeout: float) -> MpiBackend:
    """A new communicator over ``world_ranks`` (in that order), built by
    ``MPI_Comm_create_group`` on the factory communicator with a tag derived from ``label``: only
    the members take part, and creations on different threads may run at once (tags tell them
    apart). Bounded by ``timeout``: a member that never arrives raises ``CollectiveError``."""
    ranks = tuple(int(r) for r in world_ranks)
    factory = _factory(MPI)
    tag = zlib.crc32(label.encode()) % (int(factory.Get_attr(MPI.TAG_UB)) + 1)
    result: dict[str, Any] = {}
    finished = threading.Event()

    def create() -> None:
        try:
            group = factory.Get_group().Incl(list(ranks))
            try:
                result["comm"] = factory.Create_group(group, tag)
            finally:
                group.Free()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = e
        finished.set()

    creator = threading.Thread(target=create, name=f"gpucomm-mpi-create-{label}", daemon=True)
    creator.start()
    if not finished.wait(timeout):
        raise CollectiveError(f"creating MPI communicator '{label}' over world ranks {list(ranks)} did not complete "
                              f"within {timeout:g} s: some member never created it (a rank died or stalled, or the "
                              f"members did not all create this communicator). MPI cannot cancel the creation; this "
                              f"process will call MPI_Abort at exit if it is still stuck.")
    if "error" in result:
        raise CollectiveError(f"creating MPI communicator '{label}' over world ranks {list(ranks)} failed: "
                              f"{result['error']}") from result["error"]
    comm = result["comm"]
    comm.Set_name(f"gpucomm:{label}")
    return MpiBackend(MPI, comm, label=label, timeout=timeout, world_ranks=ranks)


def _factory(MPI: Any) -> Any:
    """This process's private duplicate of ``MPI_COMM_WORLD``, used only to create communicators
    (never for data, so creating one never races a collective). Made once, by the first
    ``mpi_world`` call, which every rank makes at the same point (init)."""
    global _factory_comm
    with _init_lock:
        if _factory_comm is None:
            _factory_comm = MPI.COMM_WORLD.Dup()
            _factory_comm.Set_name("gpucomm:factory")
        return _factory_comm


def mpi_world(*, timeout: float, expected_rank: int | None = None, expected_size: int | None = None,
              label: str = "world", env: Mapping[str, str] | None = None) -> MpiBackend:
    """The job's MPI backend over every rank of ``MPI_COMM_WORLD`` (initializing MPI if needed).
    Every rank calls it at the same point. ``expected_rank``/``expected_size`` (gpucomm's own view
    of the job) must be MPI's: a mismatch means the processes were not started by one MPI launcher
    (``MpiUnavailable`` says how to fix it)."""
    env = os.environ if env is None else env
    MPI = load_mpi(env)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if (expected_size is not None and expected_size != size) or (expected_rank is not None and expected_rank != rank):
        raise MpiUnavailable(
            f"MPI sees this process as rank {rank} of {size}, but the job is rank {expected_rank} of {expected_size}: "
            f"the ranks were not started by one MPI launcher (e.g. gpucomm-run without --mpi, torchrun or Slurm "
            f"start independent processes, and each is MPI's only rank). Fix: launch with `gpucomm-run --mpi`, "
            f"mpiexec or mpirun, or use Gloo (GPUCOMM_CPU_OPERATIONS=gloo).")
    return _create(MPI, range(size), label, timeout)


def mpi_group(world: MpiBackend, ranks: Sequence[int], rank: int, *, label: str | None = None) -> MpiBackend:
    """A backend over the process subset ``ranks`` (world ranks; its rank ``i`` is ``ranks[i]``),
    created by its members only; ``rank`` is this process's world rank and must be one of them.
    Every member calls it with the same ``ranks`` and ``label`` (default: derived from the ranks;
    give each communicator over the same ranks its own label)."""
    ranks = tuple(int(r) for r in ranks)
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"mpi_group: ranks {list(ranks)} must be distinct world ranks, at least one.")
    bad = [r for r in ranks if not 0 <= r < len(world.world_ranks)]
    if bad:
        raise ValueError(f"mpi_group: ranks {bad} are not ranks of the {len(world.world_ranks)}-rank job.")
    me = world.world_ranks[world.rank]
    if rank != me or rank not in ranks:
        raise ValueError(f"mpi_group: only members create a group: this process is world rank {me}, and the call "
                         f"names rank {rank} and ranks {list(ranks)}.")
    return _create(world._MPI, ranks, label or "group/" + ",".join(map(str, ranks)), world.timeout)


__all__ = ["MpiBackend", "MpiUnavailable", "MpiWork", "launcher_family", "library_family", "load_mpi", "mpi4py_installed",
           "mpi_group", "mpi_world"]
