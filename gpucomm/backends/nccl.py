"""GPU backend: a thin, table-driven wrapper of ``cupy.cuda.nccl.NcclCommunicator``.

Every call takes raw device pointers and an explicit CUDA stream, so torch tensors, CuPy arrays and
anything else with ``__cuda_array_interface__`` go through the same path. The communicator is made
from a 128-byte unique id that rank 0 publishes through the rendezvous store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

import torch

from ..counters import COUNTERS
from ..errors import CollectiveError
from .base import BackendOp

log = logging.getLogger("gpucomm.nccl")

NCCL_HINT = ("Set NCCL_DEBUG=INFO to see NCCL's own account. Across hosts, the usual cause is the network "
             "interface: choose it with NCCL_SOCKET_IFNAME (gpucomm-run --network-interface), and check that "
             "every host can reach the others on it.")


DESTROY_TIMEOUT = 30.0  # seconds a healthy shutdown waits for one communicator's destroy


def nccl_module():
    """CuPy's NCCL module, or None when CuPy or libnccl is missing."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - optional dependency
    except Exception:  # ImportError, or CuPy failing to find CUDA pieces
        return None
    return nccl if getattr(nccl, "available", False) else None


def nccl_version() -> int:
    """NCCL's version code (e.g. 23203 for 2.32.3), or 0 when NCCL cannot be loaded."""
    nccl = nccl_module()
    if nccl is None:
        return 0
    try:
        return int(nccl.get_version())
    except Exception:
        return 0


def version_text(code: int) -> str:
    """NCCL's version code as ``major.minor.patch`` (codes before 2.9 were major*1000 + minor*100 + patch)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _tables(nccl):
    dtypes = {
        torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16, torch.bfloat16: nccl.NCCL_BFLOAT16,
        torch.float64: nccl.NCCL_FLOAT64, torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64,
        torch.uint8: nccl.NCCL_UINT8, torch.int8: nccl.NCCL_INT8,
    }
    for name, const in (("uint32", "NCCL_UINT32"), ("uint64", "NCCL_UINT64")):
        if hasattr(torch, name):
            dtypes[getattr(torch, name)] = getattr(nccl, const)
    ops = {BackendOp.SUM: nccl.NCCL_SUM, BackendOp.AVG: nccl.NCCL_AVG, BackendOp.MIN: nccl.NCCL_MIN,
           BackendOp.MAX: nccl.NCCL_MAX, BackendOp.PRODUCT: nccl.NCCL_PROD}
    return dtypes, ops


RUNTIME_CONNECT_ENV = "NCCL_RUNTIME_CONNECT"
_connect_warned = False


def connect_at_init(environ: Any = os.environ) -> bool:
    """Make NCCL connect every peer while the communicator is created (``NCCL_RUNTIME_CONNECT=0``)
    unless the user chose otherwise; True when connections are made at init.

    Why: since NCCL 2.22 a communicator connects lazily, inside its first collective of each kind,
    and that host call blocks until the peers reach the same collective. gpucomm's schedules launch
    a bucket from a backward hook as soon as its gradients are ready, and a bucket holding a
    parameter unused on some rank is launched there only at ``synchronize()``; with lazy
    connections the first rank then blocks inside backward (seen on an H100 with NCCL 2.28.9: rank
    0 stuck in ncclAllReduce, rank 1 waiting for rank 0's next collective). Creating a communicator
    is a collective point on every rank, so connecting there never waits on the training loop.
    NCCL reads the variable when the process creates its first communicator."""
    global _connect_warned
    value = environ.get(RUNTIME_CONNECT_ENV, "").strip()
    if not value:  # unset, or set empty (NCCL ignores an empty value and keeps its lazy default)
        environ[RUNTIME_CONNECT_ENV] = value = "0"
    if value == "0":
        return True
    if not _connect_warned:
        _connect_warned = True
        log.warning("%s=%s: NCCL connects peers inside their first collective, which blocks until every peer "
                    "reaches it; a bucket launched inside backward on one rank and only at synchronize() on "
                    "another (a parameter unused on some ranks) can then hang the job. Unset it (gpucomm sets 0).",
                    RUNTIME_CONNECT_ENV, value)
    return False


def unique_id_bytes(uid: Any) -> bytes:
    """The 128-byte NCCL unique id as bytes, from what ``cupy.cuda.nccl.get_unique_id()`` returns:
    bytes since CuPy 14, a tuple of 128 C ``char`` values (signed, -128..127) before."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(b) & 0xFF for b in uid)


def unique_id_for_cupy(raw: bytes, cupy_major: int) -> Any:
    """``raw`` in the form CuPy ``cupy_major``'s ``NcclCommunicator`` takes: bytes since CuPy 14,
    before that the tuple of 128 signed ``char`` values its ``get_unique_id()`` returned."""
    if cupy_major >= 14:
        return bytes(raw)
    return tuple(b - 256 if b > 127 else b for b in raw)


def cupy_major() -> int:
    """CuPy's major version (0 if it cannot be read)."""
    try:
        import cupy  # noqa: PLC0415

        return int(str(cupy.__version__).split(".")[0])
    except (ImportError, ValueError):
        return 0


def nccl_reducible(dtype: torch.dtype) -> bool:
    """True if NCCL can reduce this dtype (it has no int16 or bool kernels)."""
    nccl = nccl_module()
    return nccl is not None and dtype in _tables(nccl)[0]


class NcclBackend:
    """Collectives on CUDA memory through one NCCL communicator on this process's GPU."""

    name = "nccl"

    def __init__(self, unique_id: bytes, rank: int, size: int, device_ordinal: int) -> None:
        nccl = nccl_module()
        if nccl is None:
            raise CollectiveError(
                "a CUDA tensor needs NCCL, but CuPy's NCCL bindings are unavailable in this process. Install "
                "gpucomm with the extra matching your CUDA (pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]').")
        if len(unique_id) != 128:
            raise CollectiveError(f"NCCL unique id must be 128 bytes, got {len(unique_id)}")
        import cupy  # noqa: PLC0415

        self._nccl = nccl
        self._dtypes, self._ops = _tables(nccl)
        self.rank, self.size, self.device = rank, size, device_ordinal
        self._state = "live"  # -> "aborted" or "destroyed"; both final
        self._state_lock = threading.Lock()
        try:
            # select, never ``with Device(...)``: leaving that block would select the device that was
            # current before, and in a thread that had selected none that is GPU 0 (a new context there)
            cupy.cuda.Device(device_ordinal).use()
            connect_at_init()
            try:
                self.comm = nccl.NcclCommunicator(size, unique_id_for_cupy(unique_id, cupy_major()), rank)
            except OverflowError:  # CuPy < 14 where C char is unsigned (aarch64): the tuple takes 0..255
                self.comm = nccl.NcclCommunicator(size, tuple(unique_id), rank)
        except Exception as e:
            raise CollectiveError(
                f"creating the NCCL communicator failed on rank {rank} of {size} (GPU {device_ordinal}): {e}. "
                + NCCL_HINT) from e

    # -- helpers -------------------------------------------------------------------------------
    def _dtype(self, t: torch.Tensor, reducing: bool) -> tuple[int, int]:
        """(NCCL dtype, element count); data movement of other dtypes goes as bytes."""
        code = self._dtypes.get(t.dtype)
        if code is not None:
            return code, t.numel()
        if reducing:
            raise CollectiveError(f"NCCL cannot reduce {t.dtype} tensors")
        return self._nccl.NCCL_UINT8, t.numel() * t.element_size()

    def _call(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            raise CollectiveError(f"NCCL {what} failed on rank {self.rank}: {e}. " + NCCL_HINT) from e

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        dt, n = self._dtype(send, True)
        self._call("allreduce", self.comm.allReduce, send.data_ptr(), recv.data_ptr(), n, dt, self._ops[op], stream or 0)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> None:
        dt, n = self._dtype(send, False)
        self._call("allgather", self.comm.allGather, send.data_ptr(), recv.data_ptr(), n, dt, stream or 0)

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> None:
        dt, n = self._dtype(recv, False)
        self._call("broadcast", self.comm.broadcast, send.data_ptr(), recv.data_ptr(), n, dt, root, stream or 0)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> None:
        dt, _ = self._dtype(send, False)
        k = 1 if send.dtype in self._dtypes else send.element_size()
        item = send.element_size() // k
        s_ptr, r_ptr, s_off, r_off = send.data_ptr(), recv.data_ptr(), 0, 0
        nccl, st = self._nccl, stream or 0
        nccl.groupStart()
        try:
            for peer in range(self.size):
                sc, rc = send_counts[peer] * k, recv_counts[peer] * k
                if sc:
                    self._call("alltoall send", self.comm.send, s_ptr + s_off * item, sc, dt, peer, st)
                if rc:
                    self._call("alltoall recv", self.comm.recv, r_ptr + r_off * item, rc, dt, peer, st)
                s_off, r_off = s_off + sc, r_off + rc
        finally:
            nccl.groupEnd()

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> None:
        dt, n = self._dtype(recv, True)
        self._call("reducescatter", self.comm.reduceScatter, send.data_ptr(), recv.data_ptr(), n, dt,
                   self._ops[op], stream or 0)

    def barrier(self) -> None:
        raise NotImplementedError("barriers run on the Gloo backend")

    def check_async_error(self) -> None:
        """Raise if NCCL recorded an asynchronous failure (a peer died, a network error). Under the
        state lock: an abort or destroy on another thread frees the communicator, and asking a freed
        one is undefined (it never blocks, so holding the lock is short). Nothing to ask once ended."""
        with self._state_lock:
            if self._state != "live":
                return
            self._call("async error check", self.comm.check_async_error)

    def abort(self) -> None:
        """The job failed: abort in-flight work so no stream waits forever on a dead peer (what a
        failed job does with its communicators; never ``destroy``, which waits for that work)."""
        if self._end("aborted"):
            COUNTERS.nccl_aborts += 1
            try:
                self.comm.abort()
            except Exception as e:  # noqa: BLE001 - failing anyway: nothing left to abort
                log.debug("NCCL abort: %s", e)

    def destroy(self, timeout: float | None = None) -> None:
        """Release the communicator at a collective point of a healthy job (shutdown, or an
        optimizer's close), once its work has finished. NCCL's destroy waits for work still queued;
        if that takes over ``timeout`` seconds (default ``DESTROY_TIMEOUT``; a peer that vanished
        after the last collective), the communicator is left behind with a warning: aborting it then
        would free it twice."""
        if not self._end("destroyed"):
            return
        COUNTERS.nccl_destroys += 1
        done = threading.Event()

        def destroy() -> None:
            try:
                _select(self.device)  # NCCL restores the thread's device afterwards: it must be this one
                self.comm.destroy()
            except Exception as e:  # noqa: BLE001
                log.debug("NCCL destroy: %s", e)
            finally:
                done.set()

        threading.Thread(target=destroy, name="gpucomm-nccl-destroy", daemon=True).start()
        limit = DESTROY_TIMEOUT if timeout is None else timeout
        if not done.wait(limit):
            log.warning("gpucomm: destroying the NCCL communicator of rank %d (GPU %d) did not finish within %.0f s "
                        "(work still queued for a peer that is gone?); leaving it behind", self.rank, self.device,
                        limit)

    def _end(self, state: str) -> bool:
        """Move from live to ``state``; False if it had already ended (the first ending stands: an
        abort after a destroy, or a second abort, does nothing)."""
        with self._state_lock:
            if self._state != "live":
                return False
            self._state = state
            return True

    @property
    def state(self) -> str:
        return self._state

    def close(self, *, abort: bool = False) -> None:
        """``abort()`` if ``abort`` (the job failed), else ``destroy()``."""
        self.abort() if abort else self.destroy()


def _select(ordinal: int) -> None:
    """Make ``ordinal`` the calling thread's current device (CuPy; no-op where it cannot be)."""
    try:
        import cupy  # noqa: PLC0415

        cupy.cuda.Device(ordinal).use()
    except Exception as e:  # noqa: BLE001 - no CUDA here: nothing to select
        log.debug("selecting GPU %d: %s", ordinal, e)


def create_nccl(client, key: str, rank: int, size: int, device_ordinal: int, timeout: float) -> NcclBackend:
    """A communicator of ``size`` ranks: rank 0 publishes a fresh unique id under ``key`` in the
    rendezvous store (``client``), every rank reads it and joins (a collective call)."""
    nccl = nccl_module()
    if nccl is None:
        raise CollectiveError(
            "a collective on a CUDA tensor needs NCCL, but CuPy's NCCL bindings could not be loaded. "
            "Install the extra that matches your CUDA: pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]'.")
    t0 = time.monotonic()
    if rank == 0:
        client.set(key, unique_id_bytes(nccl.get_unique_id()))
    backend = NcclBackend(client.get(key, timeout), rank, size, device_ordinal)
    log.info("NCCL communicator (%s, rank %d of %d) created in %.3f s", key, rank, size, time.monotonic() - t0)
    return backend
