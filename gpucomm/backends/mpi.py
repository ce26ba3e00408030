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

Reductions and element types: ``mpi_types``. Loading and initializing the library, and the exit hook:
``mpi_library``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import CollectiveError, MpiUnavailable
from .base import BackendOp
from .mpi_library import LIVE_BACKENDS, factory_comm, library_family, load_mpi, mpi4py_installed
from .mpi_types import HALF_TYPES, buffer_of, describe_op, half_op, move_type, overlap, reduce_op, reduce_type

log = logging.getLogger("gpucomm")

POLL_S = 0.2  # how often a wait with a ``failed`` callback asks whether the job failed elsewhere


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
        LIVE_BACKENDS.add(self)

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
            if overlap(send, recv):
                send = send.clone()
            source = [buffer_of(MPI, send), n, mpi_type]
        target = [buffer_of(MPI, recv), n, mpi_type]
        comm, average, size = self.comm, op is BackendOp.AVG, self.size

        def call() -> None:
            comm.Allreduce(source, target, mpi_op)
            if average:
                recv.div_(size)

        return self._issue(describe_op("allreduce", recv, f" ({op.value})"), call, (send, recv))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, recv_counts: Sequence[int] | None = None,
                  stream: int | None = None) -> MpiWork:
        """Every rank's ``send`` in rank order into ``recv``: equal parts, or ``recv_counts[r]``
        elements from rank ``r`` (allgatherv; gpucomm's executor pads to equal parts today)."""
        MPI, n, size = self._MPI, send.numel(), self.size
        counts = [n] * size if recv_counts is None else [int(c) for c in recv_counts]
        if len(counts) != size or counts[self.rank] != n or sum(counts) != recv.numel() or send.dtype != recv.dtype:
            raise ValueError(f"allgather: recv must hold every rank's part ({counts}, {recv.numel()} elements of "
                             f"{recv.dtype}) and this rank sends {n} {send.dtype}.")
        mtype = move_type(MPI, recv.element_size())
        displs = [sum(counts[:r]) for r in range(size)]
        at = recv.data_ptr() + displs[self.rank] * recv.element_size()
        if n and send.data_ptr() == at:
            source: Any = MPI.IN_PLACE
        else:
            if overlap(send, recv):
                send = send.clone()
            source = [buffer_of(MPI, send), n, mtype]
        comm = self.comm
        if recv_counts is None:
            target: Any = [buffer_of(MPI, recv), n, mtype]

            def call() -> None:
                comm.Allgather(source, target)
        else:
            target = [buffer_of(MPI, recv), (counts, displs), mtype]

            def call() -> None:
                comm.Allgatherv(source, target)

        return self._issue(describe_op("allgather", recv), call, (send, recv))

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> MpiWork:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is not a rank of this {self.size}-rank communicator.")
        if self.rank == root and send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        MPI, comm = self._MPI, self.comm
        target = [buffer_of(MPI, recv), recv.numel(), move_type(MPI, recv.element_size())]

        def call() -> None:
            comm.Bcast(target, root)

        return self._issue(describe_op("broadcast", recv, f" from rank {root}"), call, (recv,))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> MpiWork:
        """``send_counts[r]`` elements to rank ``r``, ``recv_counts[r]`` from it, in rank order."""
        MPI, size = self._MPI, self.size
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(sc) != size or len(rc) != size or sum(sc) > send.numel() or sum(rc) > recv.numel() \
                or send.dtype != recv.dtype:
            raise ValueError(f"alltoall: {size} send counts {sc} (of {send.numel()}) and receive counts {rc} (of "
                             f"{recv.numel()}) needed, one per rank, within the tensors, of one dtype.")
        mtype = move_type(MPI, recv.element_size())
        sd, rd = [sum(sc[:r]) for r in range(size)], [sum(rc[:r]) for r in range(size)]
        if send.data_ptr() == recv.data_ptr() and sc == rc:
            source: Any = MPI.IN_PLACE
        else:
            if overlap(send, recv):
                send = send.clone()
            source = [buffer_of(MPI, send), (sc, sd), mtype]
        target = [buffer_of(MPI, recv), (rc, rd), mtype]
        comm = self.comm

        def call() -> None:
            comm.Alltoallv(source, target)

        return self._issue(describe_op("alltoall", send), call, (send, recv))

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> MpiWork:
        """Part ``r`` (``recv.numel()`` elements) of the reduction of every rank's ``send`` to rank ``r``."""
        MPI, n, size = self._MPI, recv.numel(), self.size
        if send.numel() != n * size or send.dtype != recv.dtype:
            raise ValueError(f"reducescatter: send must hold {size} parts of {n} {recv.dtype}, got {send.numel()} "
                             f"{send.dtype}.")
        mpi_type, mpi_op = self._reduction(recv.dtype, op)
        comm, average, rank = self.comm, op is BackendOp.AVG, self.rank
        if overlap(send, recv) and recv.data_ptr() == send.data_ptr() + rank * n * send.element_size():
            # in place (recv is this rank's part of send): MPI leaves the result at the start of send
            whole = [buffer_of(MPI, send), n, mpi_type]

            def call() -> None:
                comm.Reduce_scatter_block(MPI.IN_PLACE, whole, mpi_op)
                if rank:
                    recv.copy_(send[:n])
                if average:
                    recv.div_(size)
        else:
            if overlap(send, recv):
                send = send.clone()
            source, target = [buffer_of(MPI, send), n, mpi_type], [buffer_of(MPI, recv), n, mpi_type]

            def call() -> None:
                comm.Reduce_scatter_block(source, target, mpi_op)
                if average:
                    recv.div_(size)

        return self._issue(describe_op("reducescatter", recv, f" ({op.value})"), call, (send, recv))

    def barrier(self) -> MpiWork:
        comm = self.comm
        return self._issue("barrier", lambda: comm.Barrier())

    def _reduction(self, dtype: torch.dtype, op: BackendOp) -> tuple[Any, Any]:
        MPI = self._MPI
        if op is BackendOp.AVG and not dtype.is_floating_point:
            raise ValueError(f"the MPI backend averages floating types only, not {dtype}; reduce with SUM and scale "
                             f"(gpucomm's op layer does this for hvd.Average).")
        mpi_type = reduce_type(MPI, dtype)
        return mpi_type, (half_op(MPI, dtype, op) if dtype in HALF_TYPES else reduce_op(MPI, op))

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
    factory = factory_comm(MPI)
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


__all__ = ["MpiBackend", "MpiUnavailable", "MpiWork", "library_family", "load_mpi", "mpi4py_installed",
           "mpi_group", "mpi_world"]
