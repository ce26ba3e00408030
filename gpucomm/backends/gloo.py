"""CPU backend: torch's ``ProcessGroupGloo`` built directly on gpucomm's rendezvous store.

No ``torch.distributed.init_process_group``: gpucomm touches no global torch state, so a user's own
process groups (or DDP) can live beside it.

A group closed after a failure is aborted for real: torch's ``ProcessGroupGloo.abort()`` and ``shutdown()``
do nothing (torch 2.13), so gpucomm shuts the group's TCP connections itself. Its pending transfers then
fail at once, while the interpreter is alive, and no pair of it outlives it: a pending transfer that
failed later, when a peer it waited for exited, ran on a Gloo thread that needed the GIL at the
survivor's own interpreter exit and killed it (SIGABRT ``gloo::IoException ... Connection closed by peer``,
or SIGSEGV; issue 36, finding 8).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..bootstrap.rendezvous import RendezvousClient, RendezvousTimeout
from ..errors import CollectiveError
from ..settings import GLOO_IFACE
from .base import BackendOp, torch_at_least

log = logging.getLogger("gpucomm")

INTERRUPT_POLL_S = 0.5  # how often an interruptible store wait asks whether to stop
WAIT_SLICE = datetime.timedelta(seconds=0.2)  # a wait that may be released asks ``failed()`` this often
ABORT_WAIT_S = 5.0  # an aborted group's pending works fail at once; this long at most is waited for them
PRUNE_AT = 32  # in-flight works kept before the completed ones behind a pending one are dropped
_TAGS = itertools.count(1)  # numbers the groups this process builds (see GlooBackend.__init__)
TAG_STEP_MS = 20  # a group's timeout tag is a multiple of this (the kernel rounds SO_RCVTIMEO up to a tick <= 10 ms)
TAGS = 50  # distinct tags: a group's timeout grows by less than a second

_GLOO_OPS = {
    BackendOp.SUM: dist.ReduceOp.SUM,
    BackendOp.AVG: dist.ReduceOp.AVG,
    BackendOp.MIN: dist.ReduceOp.MIN,
    BackendOp.MAX: dist.ReduceOp.MAX,
    BackendOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
# Gloo reduces bfloat16 from torch 2.2 on; with torch 2.1 ("Invalid scalar type") a bfloat16 reduction runs on a
# float32 copy (every bfloat16 is a float32; the float32 result is rounded to bfloat16 once, at the end).
GLOO_REDUCES_BF16 = torch_at_least(2, 2)
_flat_allgather = True  # Gloo's allgather into one tensor (torch >= 2.2); set False once torch says it has none
_gloo_reduce_scatter = True  # Gloo's reduce-scatter (torch >= 2.2); set False once torch says it has none
# Gloo has no kernels for these; data movement sends their bytes instead.
# (torch.uint16/32/64 exist from torch 2.3 on; CI's oldest-torch step runs 2.1)
_BYTE_MOVED = {getattr(torch, name) for name in ("bool", "int16", "uint16", "uint32", "uint64", "complex64",
                                                  "complex128") if hasattr(torch, name)}
if not GLOO_REDUCES_BF16:  # torch 2.1's Gloo knows no bfloat16 at all, for moving data either
    _BYTE_MOVED.add(torch.bfloat16)


class StoreAdapter(dist.Store):
    """Presents a prefix of our authenticated store as a ``torch.distributed.Store`` for Gloo."""

    def __init__(self, client: RendezvousClient, prefix: str, timeout: float,
                 interrupt: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._client, self._prefix, self._timeout_s = client, prefix, timeout
        self._interrupt = interrupt  # raises to stop a wait (an elastic round was replaced); asked every 0.5 s

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value) -> None:  # noqa: A003 - torch's name
        self._client.set(self._k(key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        if self._interrupt is not None:
            self._wait_interruptibly([self._k(key)], self._timeout_s)
        return self._client.get(self._k(key), self._timeout_s)

    def _wait_interruptibly(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._interrupt()
            left = deadline - time.monotonic()
            try:
                self._client.wait(keys, max(0.0, min(INTERRUPT_POLL_S, left)))
                return
            except RendezvousTimeout:
                if left <= INTERRUPT_POLL_S:
                    raise

    def add(self, key: str, value: int) -> int:
        return self._client.add(self._k(key), value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        enc = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._client.compare_set(self._k(key), enc(expected), enc(desired))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        t = self._timeout_s if timeout is None else timeout.total_seconds()
        try:
            if self._interrupt is not None:
                self._wait_interruptibly([self._k(k) for k in keys], t)
            else:
                self._client.wait([self._k(k) for k in keys], t)
        except RendezvousTimeout as e:
            raise RuntimeError(str(e)) from None

    def check(self, keys: list[str]) -> bool:
        return self._client.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._k(key))

    def num_keys(self) -> int:
        return self._client.num_keys()


class GlooWork:
    """A Gloo ``Work`` behind gpucomm's ``Work`` protocol."""

    __slots__ = ("_work",)

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout: float, failed: Callable[[], object] | None = None) -> None:
        """Block until done. The process group's own timeout (set at construction to the same value)
        applies. With ``failed``, a wait that does not finish at once also ends as soon as
        ``failed()`` is truthy (the job failed elsewhere, e.g. a peer stopped responding): Gloo cannot
        be interrupted, so the caller is released instead. It waits in slices of ``WAIT_SLICE``, not
        on a Python callback of the work's future: a Gloo thread must never need the GIL (a callback
        left on a work that ends at interpreter exit kills the process)."""
        work = self._work
        if failed is None or work.is_completed():
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:  # the slice ran out ("Operation timed out!"), or the transfer failed
                if work.is_completed():
                    work.wait()  # raises the transfer's own error
                    return
            if failed():
                raise CollectiveError("the job failed while this rank waited for the data transfer")

    def future(self):
        """A ``torch.futures.Future`` completed with the work (the timeline times ops with it)."""
        try:
            return self._work.get_future()
        except RuntimeError:
            return None


class WidenedWork(GlooWork):
    """A reduction Gloo ran on a float32 copy (``wide``) of a bfloat16 tensor: the result is copied
    back into ``recv`` once the transfer is seen complete, on the caller's thread (never a Gloo one)."""

    __slots__ = ("_wide", "_recv", "_send")

    def __init__(self, work: dist.Work, wide: torch.Tensor, recv: torch.Tensor, send: torch.Tensor | None = None) -> None:
        super().__init__(work)
        self._wide, self._recv, self._send = wide, recv, send  # the float32 input lives until the work is done

    def _land(self) -> None:
        if self._wide is not None:
            self._recv.copy_(self._wide)
            self._wide = self._send = None

    def done(self) -> bool:
        if not self._work.is_completed():
            return False
        self._land()
        return True

    def wait(self, timeout: float, failed: Callable[[], object] | None = None) -> None:
        super().wait(timeout, failed)
        self._land()


class InFlight:
    """The works a group issued that may still be running, oldest first (completed ones are dropped
    as new ones come), so that closing the group can tell whether any is pending."""

    def __init__(self) -> None:
        self._works: collections.deque[dist.Work] = collections.deque()
        self._lock = threading.Lock()  # ops are issued from several threads

    def add(self, work: dist.Work) -> dist.Work:
        with self._lock:
            works = self._works
            while works and works[0].is_completed():
                works.popleft()
            if len(works) >= PRUNE_AT:  # one long transfer at the head must not hold every later one
                self._works = works = collections.deque(w for w in works if not w.is_completed())
            works.append(work)
        return work

    def pending(self) -> list[dist.Work]:
        with self._lock:
            return [w for w in self._works if not w.is_completed()]

    def drain(self, seconds: float) -> list[dist.Work]:
        """Wait up to ``seconds`` for every work to complete; returns those still pending."""
        deadline = time.monotonic() + seconds
        pending = self.pending()
        while pending and time.monotonic() < deadline:
            time.sleep(0.005)
            pending = [w for w in pending if not w.is_completed()]
        return pending

    def take(self) -> list[dist.Work]:
        """Every work still held (the caller keeps them alive: see ``GlooBackend.close``)."""
        with self._lock:
            works, self._works = list(self._works), collections.deque()
        return works


# -- a group's connections, seen from the operating system ---------------------------------------
# Gloo hides its pairs, so a group's TCP connections are found as the sockets that appeared while the
# group was built and carry its Gloo timeout as their receive timeout (Gloo sets SO_RCVTIMEO on every
# pair; gpucomm's own sockets use Python timeouts, which leave it 0). Each group's timeout carries a tag
# of its own (a multiple of TAG_STEP_MS more), so that a group built at the same time by another thread is
# told apart; the kernel keeps the timeout in clock ticks (1-10 ms), rounded up. Sockets are named by inode,
# which never changes while a socket lives: a file descriptor number may be closed by Gloo and reused for
# another socket.


def open_sockets() -> dict[int, int]:
    """``{inode: fd}`` of the sockets this process holds (empty where ``/proc`` is not mounted)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (or the directory's own descriptor)
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


@contextlib.contextmanager
def _socket_of(inode: int, fd: int) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` as a socket if ``fd`` still names socket ``inode``, else None. The
    duplicate holds the socket itself, so what it names cannot change while it is used."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        st = os.fstat(dup)
        sock = socket.socket(fileno=dup) if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode else None
    except OSError:
        sock = None
    if sock is None:
        os.close(dup)
        yield None
        return
    with sock:  # closes the duplicate only
        yield sock


def _is_gloo_pair(sock: socket.socket, timeout: datetime.timedelta) -> bool:
    """A connected socket whose receive timeout is ``timeout`` up to the kernel's rounding (Gloo's own,
    on its pairs)."""
    try:
        sock.getpeername()
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll"))
    except OSError:
        return False
    seconds, micros = struct.unpack("ll", raw)
    above = datetime.timedelta(seconds=seconds, microseconds=micros) - timeout
    ms = datetime.timedelta(milliseconds=1)  # torch hands Gloo whole milliseconds
    return -ms < above < datetime.timedelta(milliseconds=TAG_STEP_MS // 2)


def pair_sockets(before: dict[int, int], timeout: datetime.timedelta) -> frozenset[int]:
    """The inodes of the Gloo pairs among the sockets opened since ``before`` (``open_sockets()``)."""
    pairs = set()
    for inode, fd in open_sockets().items():
        if inode in before:
            continue
        with _socket_of(inode, fd) as sock:
            if sock is not None and _is_gloo_pair(sock, timeout):
                pairs.add(inode)
    return frozenset(pairs)


def shut_sockets(inodes: frozenset[int]) -> int:
    """``shutdown(SHUT_RDWR)`` each of these sockets still open here; returns how many were shut.
    Gloo's own descriptor stays open: its event loop reads the end, fails what waits on the pair,
    and closes it (the peer sees the end too)."""
    shut = 0
    for inode, fd in open_sockets().items():
        if inode not in inodes:
            continue
        with _socket_of(inode, fd) as sock:
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:  # no longer connected: Gloo has seen its end already
                pass
    return shut


def _device(hostname: str | None, interface: str | None):
    """A Gloo TCP device that connects every pair while the group is built (never lazily, so that
    the group's connections are known: see ``pair_sockets``)."""
    kwargs = {"interface": interface} if interface else {"hostname": hostname} if hostname else {}
    make = dist.ProcessGroupGloo.create_device if kwargs else dist.ProcessGroupGloo.create_default_device
    try:
        return make(**kwargs, lazy_init=False)
    except TypeError:  # a torch without lazy initialization (before 2.6): always eager
        return make(**kwargs)


def _movable(t: torch.Tensor) -> torch.Tensor:
    """A view Gloo can move: its bytes when Gloo has no kernel for the dtype."""
    return t.view(torch.uint8) if t.dtype in _BYTE_MOVED else t


class GlooBackend:
    """Collectives on CPU tensors over one ``ProcessGroupGloo``."""

    name = "gloo"

    def __init__(self, client: RendezvousClient, prefix: str, rank: int, size: int, *, timeout: float,
                 hostname: str | None = None, interface: str | None = None,
                 interrupt: Callable[[], None] | None = None) -> None:
        self.rank, self.size = rank, size
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [_device(hostname, interface)]
        # the tag (< 1 s more) tells this group's connections from those of one built meanwhile (pair_sockets)
        opts._timeout = datetime.timedelta(seconds=timeout, milliseconds=TAG_STEP_MS * (next(_TAGS) % TAGS))
        self._store = StoreAdapter(client, prefix, timeout, interrupt)
        self._allreduce_opts = {}
        for op, gloo_op in _GLOO_OPS.items():
            o = dist.AllreduceOptions()
            o.reduceOp = gloo_op
            self._allreduce_opts[op] = o
        self._in_flight = InFlight()
        before = open_sockets()
        self.pg = dist.ProcessGroupGloo(self._store, rank, size, opts)
        self._pairs = pair_sockets(before, opts._timeout) if size > 1 else frozenset()
        if size > 1 and not self._pairs:
            log.debug("Gloo group %s: its connections were not found (no /proc?); an abort cannot end its transfers",
                      prefix)

    @property
    def connections(self) -> frozenset[int]:
        """The inodes of the group's TCP connections, found when it was built (what an abort shuts)."""
        return self._pairs

    def _issued(self, work: dist.Work) -> GlooWork:
        return GlooWork(self._in_flight.add(work))

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> GlooWork:
        if recv.dtype == torch.bfloat16 and not GLOO_REDUCES_BF16:
            wide = send.float()
            return WidenedWork(self._in_flight.add(self.pg.allreduce([wide], self._allreduce_opts[op])), wide, recv)
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        return self._issued(self.pg.allreduce([recv], self._allreduce_opts[op]))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> GlooWork:
        global _flat_allgather
        if _flat_allgather:
            try:
                return self._issued(self.pg._allgather_base(_movable(recv), _movable(send)))
            except RuntimeError as e:  # torch 2.1: "no support for _allgather_base in Gloo process group"
                if "_allgather_base" not in str(e):
                    raise
                _flat_allgather = False
        # one output tensor per rank, views of ``recv``: Gloo copies each part into its view (on its own thread)
        flat, part = _movable(recv), _movable(send)
        n = part.numel()
        return self._issued(self.pg.allgather([[flat.narrow(0, r * n, n) for r in range(self.size)]], [part]))

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> GlooWork:
        if send.data_ptr() != recv.data_ptr() and self.rank == root:
            recv.copy_(send)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self._issued(self.pg.broadcast([_movable(recv)], opts))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> GlooWork:
        k = send.element_size() if send.dtype in _BYTE_MOVED else 1  # counts are elements; byte views scale them
        return self._issued(self.pg.alltoall_base(_movable(recv), _movable(send), [c * k for c in recv_counts],
                                                  [c * k for c in send_counts], dist.AllToAllOptions()))

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> GlooWork:
        """``send`` (flat, ``size`` equal slots) reduced across the group, this rank's slot into ``recv``."""
        global _gloo_reduce_scatter
        if _gloo_reduce_scatter:
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _GLOO_OPS[op]
            try:
                if recv.dtype == torch.bfloat16 and not GLOO_REDUCES_BF16:
                    wide, wide_send = torch.empty(recv.shape, dtype=torch.float32), send.float()
                    return WidenedWork(self._in_flight.add(self.pg._reduce_scatter_base(wide, wide_send, opts)), wide,
                                       recv, wide_send)
                return self._issued(self.pg._reduce_scatter_base(recv, send, opts))
            except RuntimeError as e:  # torch 2.1: "Backend gloo does not support _reduce_scatter_base", raised
                if "_reduce_scatter_base" not in str(e):  # before anything is sent, alike on every rank
                    raise
                _gloo_reduce_scatter = False
        # no reduce-scatter in this torch's Gloo: an allreduce of a private copy (float32 for a bfloat16 one that
        # Gloo cannot reduce), this rank's slot copied into ``recv`` once it has landed
        whole = send.float() if recv.dtype == torch.bfloat16 and not GLOO_REDUCES_BF16 else send.clone()
        if op == BackendOp.AVG and whole.is_floating_point():  # that Gloo's allreduce has no AVG either: each
            whole.div_(self.size)  # input divided first, then summed
            op = BackendOp.SUM
        n = recv.numel()
        work = self.pg.allreduce([whole], self._allreduce_opts[op])
        return WidenedWork(self._in_flight.add(work), whole.narrow(0, self.rank * n, n), recv, whole)

    def barrier(self) -> GlooWork:
        return self._issued(self.pg.barrier(dist.BarrierOptions()))

    def close(self, *, abort: bool = False) -> None:
        """Release the group. ``abort`` (the job failed), or a transfer still pending after
        ``ABORT_WAIT_S`` (it would hold the group's destructor until Gloo's timeout): end every
        transfer now (``_abort``)."""
        pg, self.pg = self.pg, None  # type: ignore[assignment]
        if pg is None:
            return
        if abort or self._in_flight.drain(ABORT_WAIT_S):
            self._abort(pg)
            return
        works = self._in_flight.take()  # alive until the group is gone: no Gloo thread drops a last reference
        try:
            pg.shutdown()
        except (AttributeError, RuntimeError):  # torch 2.1 has no shutdown(): its destructor releases the group
            pass
        del pg, works

    def _abort(self, pg: dist.ProcessGroupGloo) -> None:
        """End the group's transfers while the interpreter is alive, and keep it to the end of the process.

        Its connections are shut (torch's ``abort()`` is called too, but does nothing in torch 2.13), so
        every pending transfer fails now, on a Gloo thread, with the GIL to be had; and no peer that
        exits later can end one at this process's own exit, when a Gloo thread that needs the GIL is
        killed in the middle of C++ and takes the process with it. The group is then idle but not
        destroyed: its destructor joins its threads while holding the GIL, which one of them may need
        (a work's last reference can hold a Python tensor), and it would wait for Gloo's timeout if a
        transfer had not ended. So it and its works are kept, never destroyed, not even at exit."""
        shut = shut_sockets(self._pairs)
        pending = self._in_flight.drain(ABORT_WAIT_S)
        try:
            pg.abort()
        except (AttributeError, RuntimeError) as e:  # an older torch, or nothing to abort
            log.debug("Gloo abort: %s", e)
        if pending:
            log.warning("gpucomm: a closed Gloo group must have no transfer left, but %d still ran %g s after %d of "
                        "its %d connection(s) found were shut. If a peer ends one at this process's exit, the process "
                        "may die of it (SIGABRT). Likely cause: its connections could not be found (no /proc/self/fd, "
                        "or a torch whose Gloo pairs carry no receive timeout); check that /proc is mounted.",
                        len(pending), ABORT_WAIT_S, shut, len(self._pairs))
        retired = (pg, self._in_flight.take())
        _abandoned.append(retired)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(retired))  # never destroyed, not even at interpreter exit


_abandoned: list = []  # Gloo groups of failed jobs, with their works: aborted and idle (see GlooBackend._abort)


def gloo_iface(env) -> str | None:
    """The network interface Gloo should use across hosts (``GPUCOMM_GLOO_IFACE`` / Horovod's name)."""
    return GLOO_IFACE.read(env)


@dataclass(frozen=True)
class GlooDevice:
    """Where a rank's Gloo groups listen: an address (``hostname``), or an interface whose first address
    Gloo takes; neither: Gloo's own choice (the address this host's name resolves to)."""

    hostname: str | None = None
    interface: str | None = None


def gloo_group(client: RendezvousClient, prefix: str, rank: int, size: int, *, timeout: float, device: GlooDevice,
               interrupt: Callable[[], None] | None = None) -> GlooBackend:
    """A Gloo group on the store under ``prefix``, listening where ``device`` says (the same for every group of
    a rank: the world's and each process set's). ``interrupt`` may stop its store waits."""
    return GlooBackend(client, prefix, rank, size, timeout=timeout, hostname=device.hostname,
                       interface=device.interface, interrupt=interrupt)
