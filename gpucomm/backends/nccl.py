"""GPU backend: a thin, table-driven wrapper of ``cupy.cuda.nccl.NcclCommunicator``.

Every call takes raw device pointers and an explicit CUDA stream, so torch tensors, CuPy arrays and
anything else with ``__cuda_array_interface__`` go through the same path. The communicator is made
from a 128-byte unique id that rank 0 publishes through the rendezvous store.
"""

from __future__ import annotations

import logging
import os
import pwd
import threading
import time
from typing import Any, Mapping, Sequence

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


# -- does NCCL connect a new communicator's peers lazily? -----------------------------------------
# Since 2.22 NCCL connects an algorithm's peers (ring, tree, PAT, NVLS, CollNet) inside the first
# collective that selects it, and that host call blocks until the peers reach it, unless
# NCCL_RUNTIME_CONNECT reads 0 or cuMem is off. gpucomm never writes the variable (it is process
# wide: torch's communicators and every other library's would change with it); where NCCL connects
# lazily, the optimizer runs one zero-filled pass of a layout's collectives at a collective point
# instead. The facts below are NCCL's (src/misc/param.cc ncclLoadParam, src/init.cc, 2.22-2.30).

LAZY_CONNECT_SINCE = 22200  # NCCL 2.22: NCCL_RUNTIME_CONNECT, default 1 (lazy)
ENV_PLUGIN_SINCE = 22807  # NCCL 2.28.7: settings are read through an env plugin (NCCL_ENV_PLUGIN)
HOME_FROM_ENV_SINCE = 23000  # NCCL 2.30: ~/.nccl.conf is found through $HOME (before: the passwd entry)
RUNTIME_CONNECT_ENV = "NCCL_RUNTIME_CONNECT"
CUMEM_ENABLE_ENV = "NCCL_CUMEM_ENABLE"
CUMEM_AUTO = -2  # NCCL_CUMEM_ENABLE's default: use cuMem where the driver and the GPU support it
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale
DIGITS = {8: "01234567", 10: "0123456789", 16: "0123456789abcdefABCDEF"}


def c_strtoll(text: str) -> tuple[int, bool]:
    """``strtoll(text, NULL, 0)`` as glibc computes it: (value, overflowed). Leading C whitespace
    and one sign are skipped; ``0x``/``0X`` before a hex digit means hex, another leading ``0``
    octal; digits are read as far as they go and the rest is ignored (``"1abc"`` is 1, ``"abc"``
    and ``" "`` are 0, ``"09"`` is 0); out of range clamps and sets ERANGE (``overflowed``).
    Binary ``0b`` is not a prefix: NCCL links the pre-C23 ``strtoll``."""
    i, n = 0, len(text)
    while i < n and text[i] in C_SPACE:
        i += 1
    sign = 1
    if i < n and text[i] in "+-":
        sign, i = (-1 if text[i] == "-" else 1), i + 1
    base = 10
    if text.startswith(("0x", "0X"), i) and i + 2 < n and text[i + 2] in DIGITS[16]:
        base, i = 16, i + 2
    elif text.startswith("0", i):
        base = 8
    j = i
    while j < n and text[j] in DIGITS[base]:
        j += 1
    value = sign * int(text[i:j], base) if j > i else 0
    if value > INT64_MAX:
        return INT64_MAX, True
    if value < INT64_MIN:
        return INT64_MIN, True
    return value, False


def nccl_int_setting(raw: str | None, default: int) -> int:
    """The value NCCL gives an integer setting whose string is ``raw`` (``ncclLoadParam``): unset
    or empty is the default; otherwise ``strtoll(raw, NULL, 0)`` (see ``c_strtoll``: no error for
    trailing text or no digits at all), and the default again only when that overflows."""
    if not raw:
        return default
    value, overflowed = c_strtoll(raw)
    return default if overflowed else value


def nccl_conf_files(environ: Mapping[str, str], version: int) -> list[str]:
    """The files NCCL reads settings from, in its order: ``NCCL_CONF_FILE`` if set and not empty,
    else ``~/.nccl.conf``; then ``/etc/nccl.conf``. A file's line counts only where neither the
    environment nor an earlier line or file set the name (NCCL calls ``setenv(..., 0)``)."""
    user = environ.get("NCCL_CONF_FILE")
    if user:
        return [user, "/etc/nccl.conf"]
    home = environ.get("HOME") if version >= HOME_FROM_ENV_SINCE else passwd_home()
    return ([f"{home}/.nccl.conf"] if home is not None else []) + ["/etc/nccl.conf"]


def passwd_home() -> str | None:
    """This user's home directory from the passwd database (what NCCL < 2.30 uses, not $HOME)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except (KeyError, OSError):
        return None


def conf_file_setting(path: str, name: str, version: int) -> str | None:
    """``name``'s value in the NCCL configuration file ``path`` (None: not there, or no such file).
    NCCL's format: ``NAME=value`` lines, nothing trimmed but the newline (and, since 2.30, a
    carriage return before it), ``#`` first for a comment, the first line naming it wins."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "surrogateescape")
    except OSError:
        return None
    for line in text.split("\n"):
        if version >= HOME_FROM_ENV_SINCE and line.endswith("\r"):
            line = line[:-1]
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and key[:1023] == name:
            return value[:1023]
    return None


def nccl_env_value(name: str, environ: Mapping[str, str], conf_files: Sequence[str], version: int) -> str | None:
    """The string NCCL reads for ``name``: the environment's, else the first configuration file's."""
    if name in environ:
        return environ[name]
    for path in conf_files:
        value = conf_file_setting(path, name, version)
        if value is not None:
            return value
    return None


def cumem_may_be_on(param: int) -> bool:
    """Whether NCCL's ``ncclCuMemEnable()`` may be true for ``NCCL_CUMEM_ENABLE`` = ``param``: it
    truncates the value to a C int, then >= 0 is the answer itself and -2 (the default) asks the
    driver (CUDA >= 12.0 and the GPU's virtual memory management), which Python cannot see without
    loading CUDA: assumed on (the safe answer). Any other negative value is off."""
    value = (param + (1 << 31)) % (1 << 32) - (1 << 31)
    return value != 0 if value >= 0 else value == CUMEM_AUTO


def connects_lazily(environ: Mapping[str, str] = os.environ, version: int | None = None, *,
                    conf_files: Sequence[str] | None = None) -> bool:
    """True when a communicator this process creates through NCCL ``version`` (default: the one
    CuPy loads; 0 when none) may connect its peers inside its first collective rather than at
    creation, given ``environ`` and NCCL's configuration files (``conf_files``: default NCCL's own).

    Why it matters: that first call blocks the host until every peer reaches it, so a caller must
    then run the collectives a training step will run once, at a point every rank reaches (the
    optimizer's zero-filled pass after its layout is agreed). NCCL connects one algorithm at a time,
    every channel and protocol of it, when a collective first selects it; the algorithm depends on
    the collective, dtype, op and element count and on how calls are grouped. So the pass must run,
    on each communicator, the step's own calls: same kinds, dtypes, ops and counts, grouped alike.

    NCCL's rule (src/init.cc): lazy iff ``NCCL_RUNTIME_CONNECT`` (default 1) is non-zero and cuMem is
    on for every rank. Where the answer cannot be known here it is True (a needless pass costs one
    step's collectives; a missing one can hang): cuMem auto-detection, another rank's settings, an
    external env plugin (``NCCL_ENV_PLUGIN``, NCCL >= 2.28.7). Not seen: a ``libnccl-env.so`` NCCL
    finds by itself, and a value changed after the process's first communicator (NCCL reads it once)."""
    code = nccl_version() if version is None else version
    if code < LAZY_CONNECT_SINCE:
        return False
    files = nccl_conf_files(environ, code) if conf_files is None else list(conf_files)
    plugin = nccl_env_value("NCCL_ENV_PLUGIN", environ, files, code) if code >= ENV_PLUGIN_SINCE else None
    if plugin and plugin.lower() != "none":
        return True  # the plugin answers NCCL's reads: its value of the variable is not ours to see
    if nccl_int_setting(nccl_env_value(RUNTIME_CONNECT_ENV, environ, files, code), 1) == 0:
        return False
    return cumem_may_be_on(nccl_int_setting(nccl_env_value(CUMEM_ENABLE_ENV, environ, files, code), CUMEM_AUTO))


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
