"""CPU backend: torch's ``ProcessGroupGloo`` built directly on gpucomm's rendezvous store.

No ``torch.distributed.init_process_group``: gpucomm touches no global torch state, so a user's own
process groups (or DDP) can live beside it.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..bootstrap.rendezvous import RendezvousClient, RendezvousTimeout
from ..errors import CollectiveError
from .base import BackendOp

log = logging.getLogger("gpucomm")

INTERRUPT_POLL_S = 0.5  # how often an interruptible store wait asks whether to stop

_GLOO_OPS = {
    BackendOp.SUM: dist.ReduceOp.SUM,
    BackendOp.AVG: dist.ReduceOp.AVG,
    BackendOp.MIN: dist.ReduceOp.MIN,
    BackendOp.MAX: dist.ReduceOp.MAX,
    BackendOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
# Gloo has no kernels for these; data movement sends their bytes instead.
_BYTE_MOVED = {torch.bool, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128}


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
        applies; passing one here takes a slower path in torch. With ``failed``, a wait that does
        not finish at once also ends as soon as ``failed()`` is truthy (the job failed elsewhere, e.g.
        a peer stopped responding): Gloo cannot be interrupted, so the caller is released instead."""
        work = self._work
        if failed is None or work.is_completed():
            work.wait()
            return
        try:
            future = work.get_future()
        except RuntimeError:
            work.wait()
            return
        finished = threading.Event()
        future.add_done_callback(lambda _f: finished.set())
        while not finished.wait(0.2):
            if failed():
                raise CollectiveError("the job failed while this rank waited for the data transfer")
        work.wait()  # raises the transfer's own error, if it had one

    def future(self):
        """A ``torch.futures.Future`` completed with the work (the timeline times ops with it)."""
        try:
            return self._work.get_future()
        except RuntimeError:
            return None


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
        if interface:
            device = dist.ProcessGroupGloo.create_device(interface=interface)
        elif hostname:
            device = dist.ProcessGroupGloo.create_device(hostname=hostname)
        else:
            device = dist.ProcessGroupGloo.create_default_device()
        opts._devices = [device]
        opts._timeout = datetime.timedelta(seconds=timeout)
        self._store = StoreAdapter(client, prefix, timeout, interrupt)
        self._allreduce_opts = {}
        for op, gloo_op in _GLOO_OPS.items():
            o = dist.AllreduceOptions()
            o.reduceOp = gloo_op
            self._allreduce_opts[op] = o
        self.pg = dist.ProcessGroupGloo(self._store, rank, size, opts)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> GlooWork:
        if send.data_ptr() != recv.data_ptr():
            recv.copy_(send)
        return GlooWork(self.pg.allreduce([recv], self._allreduce_opts[op]))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, *, stream: int | None = None) -> GlooWork:
        return GlooWork(self.pg._allgather_base(_movable(recv), _movable(send)))

    def broadcast(self, send: torch.Tensor, recv: torch.Tensor, *, root: int, stream: int | None = None) -> GlooWork:
        if send.data_ptr() != recv.data_ptr() and self.rank == root:
            recv.copy_(send)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return GlooWork(self.pg.broadcast([_movable(recv)], opts))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                 *, stream: int | None = None) -> GlooWork:
        k = send.element_size() if send.dtype in _BYTE_MOVED else 1  # counts are elements; byte views scale them
        return GlooWork(self.pg.alltoall_base(_movable(recv), _movable(send), [c * k for c in recv_counts],
                                              [c * k for c in send_counts], dist.AllToAllOptions()))

    def reducescatter(self, send: torch.Tensor, recv: torch.Tensor, *, op: BackendOp, stream: int | None = None) -> GlooWork:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _GLOO_OPS[op]
        return GlooWork(self.pg._reduce_scatter_base(recv, send, opts))

    def barrier(self) -> GlooWork:
        return GlooWork(self.pg.barrier(dist.BarrierOptions()))

    def close(self, *, abort: bool = False) -> None:
        """Release the group. ``abort`` (the job failed): break off transfers still in flight (a
        peer that stopped would otherwise hold a graceful shutdown until Gloo's timeout)."""
        pg, self.pg = self.pg, None  # type: ignore[assignment]
        if pg is None:
            return
        if abort:
            # Gloo cannot interrupt a transfer, and both shutdown() and the group's destructor join its
            # worker threads, which wait for a peer that may never answer (until Gloo's timeout). Keep
            # the group alive for the rest of the process instead: its threads end with the process. (If
            # the peer resumes, such a transfer may still finish and write into the failed collective's
            # tensors: after a failure their contents are undefined.) abort() first, where torch's Gloo
            # has it: it ends what it can of the group's operations and connections, so a peer exiting
            # later meets no open pair of a group that nothing uses any more.
            try:
                pg.abort()
            except (AttributeError, RuntimeError) as e:  # an older torch, or nothing to abort
                log.debug("Gloo abort: %s", e)
            _abandoned.append(pg)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # never destroyed, not even at interpreter exit
            return
        try:
            pg.shutdown()
        except RuntimeError:
            pass


_abandoned: list = []  # Gloo groups left behind by failed jobs (see GlooBackend.close)


def gloo_iface(env) -> str | None:
    """The network interface Gloo should use across hosts (``GPUCOMM_GLOO_IFACE`` / Horovod's name)."""
    return env.get("GPUCOMM_GLOO_IFACE") or env.get("HOROVOD_GLOO_IFACE")


def gloo_group(client: RendezvousClient, prefix: str, rank: int, size: int, *, timeout: float, one_host: bool,
               iface: str | None, interrupt: Callable[[], None] | None = None) -> GlooBackend:
    """A Gloo group on the store under ``prefix``: on loopback when every rank is on one host, else
    on ``iface`` (or the default route's interface). ``interrupt`` may stop its store waits."""
    return GlooBackend(client, prefix, rank, size, timeout=timeout,
                       hostname="127.0.0.1" if one_host and not iface else None, interface=iface, interrupt=interrupt)
