"""nccl-tests for gpucomm: allreduce, allgather, broadcast, alltoall and reducescatter swept over sizes,
with gpucomm, raw CuPy NCCL and torch.distributed side by side in the same job.

    gpucomm-run -np 2 python benchmarks/collectives.py --device cpu                  # Gloo, 8 B .. 4 MiB
    gpucomm-run -np 8 python benchmarks/collectives.py -b 8 -e 1G -f 2               # one GPU per rank
    gpucomm-run -np 2 --single-gpu-test python benchmarks/collectives.py -e 64M      # 2 ranks share a GPU
    gpucomm-run --mpi -np 2 python benchmarks/collectives.py --device cpu --cpu-operations mpi  # CPU on MPI

``--cpu-operations mpi|gloo`` sets gpucomm's CPU transport (``GPUCOMM_CPU_OPERATIONS``; MPI needs an MPI
launcher); torch.distributed stays on Gloo, and the summary and JSON (``env.cpu_operations``) count the
collectives gpucomm ran on each transport.

Every table is nccl-tests' own (``src/common.cu``): size (B), count (elements), type, redop, root, then
time (us), algbw, busbw (GB/s, 1e9 B) and #wrong for the out-of-place and the in-place call, and a footer
with the number of wrong results and the average bus bandwidth. Sizes, counts and bandwidths use
nccl-tests' definitions (STYLE.md section 5):

    collective     size column (S)            count column      busbw = algbw * ...
    allreduce      count * elsize             count             2(n-1)/n
    allgather      sendcount * n * elsize     sendcount         (n-1)/n
    reducescatter  recvcount * n * elsize     recvcount         (n-1)/n
    alltoall       count * n * elsize         count per peer    (n-1)/n
    broadcast      count * elsize             count             1

with algbw = S / time. Sizes that leave no element per rank are skipped (nccl-tests prints them as 0).

Timing follows nccl-tests' BenchTime: -w warm-up calls at the largest and the smallest size, then per
size one untimed call, a barrier, and -n calls back to back (pipelined; -z 1 waits for completion and
runs a barrier after each call) timed with CUDA events on the current stream (GPU) or the host clock
(CPU, where every call already returns complete). The time is per call and, as nccl-tests' default
``-a 1``, averaged over ranks (0: rank 0's, 2: the minimum, 3: the maximum), so every rank holds the
same table; rank 0 prints it. Checking (-c 1) then refills the buffers, runs the call once, and counts
the elements that differ from the expected result on every rank; #wrong is the sum over ranks.
Inputs are small integers chosen per operation so every result is exact in every dtype (see
``input_values``); only ``avg`` on floating types gets a tolerance of (n+1) ulps, since an average
may be computed by scaling each input by 1/n, which rounds.

Implementations:
  gpucomm  ``import gpucomm.torch as hvd``: out-of-place is the function that returns a new tensor
           (hvd.allreduce, hvd.allgather, hvd.broadcast, hvd.alltoall, hvd.reducescatter), in-place the
           ``_`` form (hvd.allreduce_, hvd.broadcast_). Horovod has no in-place allgather, alltoall or
           reducescatter, so those columns read N/A rather than timing the out-of-place path again under
           an in-place label, which would make the in-place comparison with nccl/torch meaningless.
  nccl     a ``cupy.cuda.nccl.NcclCommunicator`` of its own (unique id shared with
           hvd.broadcast_object) called with data_ptr()s on torch's current stream: the floor that
           gpucomm's Python dispatch adds to. CUDA only.
  torch    torch.distributed on its own default group (NCCL on CUDA, Gloo on CPU). It has only in-place
           allreduce and broadcast, so their out-of-place form is what a user writes: copy, then call.
In-place alltoall is N/A for every implementation: none has one (nccl-tests times its aliased
send/recv but reports #wrong as N/A, since the result is undefined).

Defaults: -b 8, -e 32M on CUDA and 4M on CPU (Gloo over loopback on a small machine; the full CPU sweep
then takes tens of seconds), -f 2, -w 5, -n 20, -d float, -o sum, -r 0, -c 1, -z 0, -a 1.
``--quick`` is a tiny sweep for tests (8 B .. 64 KiB by 8x, -w 1 -n 2). Writes ``--json`` (every row,
every implementation, the environment) and ``--plot`` (busbw against size, one line per implementation,
one panel per collective), by default under bench-out/. Exits 1 when any result is wrong, as nccl-tests does, and 2 when the
requested device or implementation is unavailable or a flag is out of range (one line on stderr).

Every table's JSON entry carries ``counters``: the gpucomm counters (``hvd.stats()``) that its timed calls
moved (0 for the anchors' tables, by construction); ``env.gpucomm_counters`` sums gpucomm's and names the
counters this gpucomm does not have, and the summary prints the ones that moved, so a run shows which path
gpucomm's calls took (the control round, the inline path, events, fast synchronous ops). In the
single-GPU test mode (ranks share one GPU; NCCL crosses loopback sockets) the run sets
``NCCL_SOCKET_NTHREADS`` and ``NCCL_NSOCKS_PERTHREAD`` before NCCL starts, unless already set (values and
why: benchmarks/anchors.py), for gpucomm, raw NCCL and torch.distributed alike, and records them in
``env.nccl_sockets``.

The closing summary averages busbw per table; at 1 rank, where nccl-tests' factor makes busbw 0 for
every collective but broadcast, it (and the plot) use algbw instead. A table with no rows (every case
skipped, or no size with an element per rank) reads n/a with the reason, and implementations left out
of a default run (raw NCCL on CPU, torch.distributed without Gloo/NCCL) are listed as not measured.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import gpucomm
import gpucomm.torch as hvd
from gpucomm.backends.nccl import nccl_module, version_text
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from torch_group import init_torch_group  # noqa: E402
from bench_stats import NA as NOT_AVAILABLE, fmt, median, write_json as write_strict_json  # noqa: E402
import anchors  # noqa: E402

COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
REDUCING = frozenset({"allreduce", "reducescatter"})
IMPLS = ("gpucomm", "nccl", "torch")
# nccl-tests' type names, in its "-d all" order (uint32/uint64 left out: gpucomm does not carry them).
DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
          "half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float",
                 "fp32": "float", "float64": "double", "fp64": "double", "bf16": "bfloat16"}
OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' "-o all" order
AVERAGE_MODES = {0: "rank 0's time", 1: "average over ranks", 2: "minimum over ranks", 3: "maximum over ranks"}
NA = "N/A"


# ---------------------------------------------------------------------------------------------
# sizes and bandwidth (nccl-tests' getCollByteCount and GetBw)


@dataclass(frozen=True)
class Layout:
    """Element counts of one call, as nccl-tests' ``*GetCollByteCount`` defines them."""

    sendcount: int
    recvcount: int
    paramcount: int  # the count column: what the NCCL call takes as ``count``
    send_ip_offset: int  # in-place: the send buffer starts at recv + rank * send_ip_offset
    recv_ip_offset: int  # in-place: the recv buffer starts at recv + rank * recv_ip_offset


def layout(coll: str, nbytes: int, elsize: int, nranks: int) -> Layout:
    """The counts nccl-tests uses for a sweep point of ``nbytes`` bytes."""
    count = nbytes // elsize
    per = count // nranks
    if coll in ("allreduce", "broadcast"):
        return Layout(count, count, count, 0, 0)
    if coll == "allgather":
        return Layout(per, per * nranks, per, per, 0)
    if coll == "reducescatter":
        return Layout(per * nranks, per, per, 0, per)
    if coll == "alltoall":
        return Layout(per * nranks, per * nranks, per, 0, 0)
    raise ValueError(f"unknown collective {coll!r}; choose from {', '.join(COLLECTIVES)}")


def busbw_factor(coll: str, nranks: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if coll == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if coll in ("allgather", "reducescatter", "alltoall"):
        return (nranks - 1) / nranks
    if coll == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {coll!r}; choose from {', '.join(COLLECTIVES)}")


def bandwidth(coll: str, paramcount: int, elsize: int, nranks: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one call that took ``seconds``."""
    total = paramcount * elsize * (1 if coll in ("allreduce", "broadcast") else nranks)
    algbw = total / 1e9 / seconds if seconds > 0 else math.inf
    return algbw, algbw * busbw_factor(coll, nranks)


def sweep(minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int) -> list[int]:
    """The sizes nccl-tests visits: times ``stepfactor`` when it is above 1, else plus ``stepbytes``."""
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes


def parse_size(text: str) -> int:
    """nccl-tests' size syntax: a number with an optional K, M or G (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgG]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write bytes with an optional K, M or G "
                                         f"(e.g. 8, 64K, 32M)")
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * unit)


# ---------------------------------------------------------------------------------------------
# inputs and expected results


def _prod_period(dtype: torch.dtype, nranks: int) -> int:
    """At each index, one rank in every ``period`` contributes 2 and the rest 1, so a product is 2**k
    with k at most ceil(nranks / period), kept small enough to be exact (no overflow) in ``dtype``."""
    bits = {torch.int8: 6, torch.uint8: 7, torch.float16: 15, torch.bfloat16: 15}.get(dtype, 30)
    return max(3, math.ceil(nranks / bits))


def _mix(idx: torch.Tensor, rank: int = -1) -> torch.Tensor:
    """A deterministic pseudo-random value in 0..32767 per (index, rank): patterns with no short
    period, so a result shifted, swapped or taken from the wrong slice does not match by accident
    (a plain ``(i + r) % 4`` sums to the same value everywhere when n is a multiple of 4)."""
    return ((idx * 1103515245 + rank * 2654435769 + 12345) % 2147483648) // 65536


def input_values(kind: str, idx: torch.Tensor, rank: int, nranks: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s values at element indices ``idx`` (int64), small integers so results are exact.

    ``kind`` is a reduction op, or ``none`` for data movement, where the values depend on the sender so
    a chunk delivered to the wrong place is counted. Every input is in 0..100 (exact even in int8 and
    bfloat16); sums stay at most 3n, products are powers of two (see ``_prod_period``), and ``avg``
    inputs are ``k(i) + s(rank)`` with the s summing to 0, so the mean is the integer k(i) in 1..3.
    """
    if kind in ("none", "min", "max"):
        return _mix(idx, rank) % 101
    if kind == "sum":
        return _mix(idx, rank) % 4
    if kind == "prod":
        return torch.where((_mix(idx) + rank) % _prod_period(dtype, nranks) == 0, 2, 1)
    if kind == "avg":
        shift = 0 if (nranks % 2 and rank == nranks - 1) else (1 if rank % 2 == 0 else -1)
        return 1 + _mix(idx) % 3 + shift
    raise ValueError(f"unknown op {kind!r}; choose from {', '.join(OPS)}")


def _cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 -> dtype: integers wrap as the wire types do, floats are exact for these magnitudes."""
    return values.to(dtype) if not dtype.is_floating_point else values.double().to(dtype)


def make_input(kind: str, start: int, n: int, rank: int, nranks: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return _cast(input_values(kind, idx, rank, nranks, dtype), dtype)


_COMBINE = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}


def reduce_expected(op: str, start: int, n: int, nranks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Elements [start, start+n) of the reduction of every rank's input."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    acc = input_values(op, idx, 0, nranks, dtype)
    for r in range(1, nranks):
        acc = _COMBINE[op](acc, input_values(op, idx, r, nranks, dtype))
    if op == "avg":
        acc = acc // nranks  # exact: the inputs were built so the sum is a multiple of nranks
    return _cast(acc, dtype)


def expected_result(coll: str, lay: Layout, op: str, root: int, rank: int, nranks: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """What this rank's receive buffer must hold after the call (flat)."""
    if coll == "allreduce":
        return reduce_expected(op, 0, lay.recvcount, nranks, dtype, device)
    if coll == "reducescatter":
        return reduce_expected(op, rank * lay.recvcount, lay.recvcount, nranks, dtype, device)
    if coll == "broadcast":
        return make_input("none", 0, lay.recvcount, root, nranks, dtype, device)
    if coll == "allgather":
        return torch.cat([make_input("none", 0, lay.sendcount, r, nranks, dtype, device) for r in range(nranks)])
    if coll == "alltoall":  # chunk r comes from rank r, which sent us its chunk number `rank`
        c = lay.paramcount
        return torch.cat([make_input("none", rank * c, c, r, nranks, dtype, device) for r in range(nranks)])
    raise ValueError(f"unknown collective {coll!r}")


def tolerance(op: str, dtype: torch.dtype, nranks: int) -> float:
    """Relative error allowed: none, except ``avg`` of floats (scaling each input by 1/n rounds)."""
    if op != "avg" or not dtype.is_floating_point:
        return 0.0
    return (nranks + 1) * torch.finfo(dtype).eps


def count_wrong(got: torch.Tensor, want: torch.Tensor, rel_tol: float = 0.0) -> int:
    """Elements of ``got`` that differ from ``want`` (all of them when the sizes differ)."""
    got, want = got.reshape(-1), want.reshape(-1)
    if got.numel() != want.numel():
        return max(got.numel(), want.numel())
    if rel_tol == 0.0:
        return int((got != want).sum())
    g, w = got.double(), want.double()
    return int(((g - w).abs() > rel_tol * w.abs().clamp(min=1.0)).sum()) + int(g.isnan().sum())


def sentinel(dtype: torch.dtype) -> int:
    """Receive buffers start with this: inputs and results are >= 0 (short of integer overflow at
    very large rank counts), so a result never written is counted."""
    return 255 if dtype == torch.uint8 else -1


def input_kind(coll: str, op: str) -> str:
    return op if coll in REDUCING else "none"


@dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor


def make_buffers(coll: str, lay: Layout, op: str, rank: int, nranks: int, dtype: torch.dtype,
                 device: torch.device, in_place: bool) -> Buffers:
    """Filled send and receive buffers; in place they overlap as nccl-tests lays them out."""
    kind = input_kind(coll, op)
    fill = sentinel(dtype)
    if not in_place:
        return Buffers(make_input(kind, 0, lay.sendcount, rank, nranks, dtype, device),
                       torch.full((lay.recvcount,), fill, dtype=dtype, device=device))
    size = max(lay.sendcount, lay.recvcount)
    buf = torch.full((size,), fill, dtype=dtype, device=device)
    send = buf[rank * lay.send_ip_offset: rank * lay.send_ip_offset + lay.sendcount]
    recv = buf[rank * lay.recv_ip_offset: rank * lay.recv_ip_offset + lay.recvcount]
    send.copy_(make_input(kind, 0, lay.sendcount, rank, nranks, dtype, device))
    return Buffers(send, recv)


# ---------------------------------------------------------------------------------------------
# implementations: run(coll, send, recv) returns the tensor that holds this rank's result


class Impl:
    """One way of calling the collectives; ``None`` from ``unsupported`` means it can run."""

    name = ""
    label = ""

    def in_place(self, coll: str) -> bool:
        """Whether this implementation has an in-place form of ``coll``."""
        return coll != "alltoall"

    def unsupported(self, coll: str, dtype: torch.dtype, op: str) -> str | None:
        return None

    def api(self, coll: str) -> str:
        return ""

    def run(self, coll: str, send: torch.Tensor, recv: torch.Tensor, *, op: str, root: int, in_place: bool):
        raise NotImplementedError

    def close(self) -> None:
        pass


class GpucommImpl(Impl):
    name, label = "gpucomm", "gpucomm (import gpucomm.torch as hvd)"
    _OPS = {"sum": hvd.Sum, "prod": hvd.Product, "min": hvd.Min, "max": hvd.Max, "avg": hvd.Average}

    def in_place(self, coll: str) -> bool:
        return coll in ("allreduce", "broadcast")  # Horovod's only in-place collectives

    def api(self, coll: str) -> str:
        return f"hvd.{coll}" + (f" / hvd.{coll}_" if self.in_place(coll) else "")

    def run(self, coll, send, recv, *, op, root, in_place):
        if coll == "allreduce":
            return hvd.allreduce_(recv, op=self._OPS[op]) if in_place else hvd.allreduce(send, op=self._OPS[op])
        if coll == "broadcast":
            return hvd.broadcast_(recv, root) if in_place else hvd.broadcast(send, root)
        if coll == "allgather":
            return hvd.allgather(send)
        if coll == "alltoall":
            return hvd.alltoall(send)
        if coll == "reducescatter":
            return hvd.reducescatter(send, op=self._OPS[op])
        raise ValueError(f"unknown collective {coll!r}")


class TorchImpl(Impl):
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.label = f"torch.distributed ({self.backend})"
        self._store = init_torch_group(self.backend)
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
        # all_gather_single / reduce_scatter_single replace the *_tensor names in recent torch.
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def unsupported(self, coll, dtype, op):
        if self.backend == "gloo" and op == "avg" and not dtype.is_floating_point:
            return "Gloo's ReduceOp.AVG cannot write an integer result"
        return None

    def api(self, coll: str) -> str:
        return {"allreduce": "all_reduce", "allgather": self._gather.__name__, "broadcast": "broadcast",
                "alltoall": "all_to_all_single", "reducescatter": self._scatter.__name__}[coll]

    def run(self, coll, send, recv, *, op, root, in_place):
        if coll == "allreduce":  # no out-of-place form: copy, then reduce in place
            if not in_place:
                recv.copy_(send)
            dist.all_reduce(recv, op=self._ops[op])
        elif coll == "broadcast":
            if not in_place and dist.get_rank() == root:
                recv.copy_(send)
            dist.broadcast(recv, root)
        elif coll == "allgather":
            self._gather(recv, send)
        elif coll == "reducescatter":
            self._scatter(recv, send, op=self._ops[op])
        elif coll == "alltoall":
            dist.all_to_all_single(recv, send)
        else:
            raise ValueError(f"unknown collective {coll!r}")
        return recv

    def close(self) -> None:
        dist.destroy_process_group()
        self._store = None


class NcclImpl(Impl):
    """Raw CuPy NCCL: the same calls nccl-tests makes, one per collective, on torch's current stream."""

    name = "nccl"

    def __init__(self, nccl) -> None:
        import cupy  # noqa: PLC0415 - present whenever nccl_module() is

        self._nccl = nccl
        self.label = f"raw NCCL {version_text(nccl.get_version())} (cupy.cuda.nccl)"
        uid = nccl.get_unique_id() if hvd.rank() == 0 else None
        uid = hvd.broadcast_object(uid, 0, name="bench.nccl_uid")  # bytes (CuPy >= 14) or a tuple: sent as is
        with cupy.cuda.Device(torch.cuda.current_device()):
            self.comm = nccl.NcclCommunicator(hvd.size(), uid, hvd.rank())
        self._dtypes = {torch.int8: nccl.NCCL_INT8, torch.uint8: nccl.NCCL_UINT8, torch.int32: nccl.NCCL_INT32,
                        torch.int64: nccl.NCCL_INT64, torch.float16: nccl.NCCL_FLOAT16,
                        torch.float32: nccl.NCCL_FLOAT32, torch.float64: nccl.NCCL_FLOAT64,
                        torch.bfloat16: nccl.NCCL_BFLOAT16}
        self._ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "min": nccl.NCCL_MIN, "max": nccl.NCCL_MAX,
                     "avg": nccl.NCCL_AVG}

    def api(self, coll: str) -> str:
        return {"allreduce": "allReduce", "allgather": "allGather", "broadcast": "broadcast",
                "alltoall": "send/recv in a group", "reducescatter": "reduceScatter"}[coll]

    def run(self, coll, send, recv, *, op, root, in_place):
        stream, dt, c = torch.cuda.current_stream().cuda_stream, self._dtypes[send.dtype], self.comm
        if coll == "allreduce":
            c.allReduce(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, self._ops[op], stream)
        elif coll == "broadcast":
            c.broadcast(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, root, stream)
        elif coll == "allgather":
            c.allGather(send.data_ptr(), recv.data_ptr(), send.numel(), dt, stream)
        elif coll == "reducescatter":
            c.reduceScatter(send.data_ptr(), recv.data_ptr(), recv.numel(), dt, self._ops[op], stream)
        elif coll == "alltoall":
            n = hvd.size()
            chunk = send.numel() // n
            step = chunk * send.element_size()
            self._nccl.groupStart()
            try:
                for peer in range(n):
                    c.send(send.data_ptr() + peer * step, chunk, dt, peer, stream)
                    c.recv(recv.data_ptr() + peer * step, chunk, dt, peer, stream)
            finally:
                self._nccl.groupEnd()
        else:
            raise ValueError(f"unknown collective {coll!r}")
        return recv

    def close(self) -> None:
        torch.cuda.synchronize()
        self.comm.destroy()


# ---------------------------------------------------------------------------------------------
# timing and checking one call


@dataclass
class Case:
    """One table's fixed parameters."""

    coll: str
    impl: Impl
    dtype_name: str
    op: str  # a reduction op, or "none"
    root: int  # broadcast's root, -1 elsewhere
    device: torch.device
    counters: dict[str, int] = field(default_factory=dict)  # gpucomm's counters moved by the timed calls

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def call(case: Case, bufs: Buffers, in_place: bool):
    return case.impl.run(case.coll, bufs.send, bufs.recv, op=case.op, root=max(case.root, 0), in_place=in_place)


def time_calls(case: Case, bufs: Buffers, in_place: bool, iters: int, blocking: bool) -> float:
    """Seconds per call on this rank: ``iters`` calls back to back (or each completed, then a barrier)."""
    call(case, bufs, in_place)  # nccl-tests' untimed "sync" call
    synchronize(case.device)
    hvd.barrier()
    before = hvd.stats()
    if case.device.type == "cpu":  # every call returns complete: the host clock is the measure
        t0 = time.perf_counter()
        _calls(case, bufs, in_place, iters, blocking)
        seconds = time.perf_counter() - t0
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _calls(case, bufs, in_place, iters, blocking)
        end.record()  # every implementation leaves the current stream waiting on its collective
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    anchors.add_counts(case.counters, anchors.counter_delta(before, hvd.stats()))
    return seconds / iters


def _calls(case: Case, bufs: Buffers, in_place: bool, iters: int, blocking: bool) -> None:
    for _ in range(iters):
        call(case, bufs, in_place)
        if blocking:
            synchronize(case.device)
            hvd.barrier()


def check_call(case: Case, lay: Layout, in_place: bool) -> int:
    """Wrong elements on this rank after one call on freshly filled buffers."""
    rank, n = hvd.rank(), hvd.size()
    bufs = make_buffers(case.coll, lay, case.op, rank, n, case.dtype, case.device, in_place)
    got = call(case, bufs, in_place)
    synchronize(case.device)
    want = expected_result(case.coll, lay, case.op, case.root, rank, n, case.dtype, case.device)
    return count_wrong(got, want, tolerance(case.op, case.dtype, n))


def measure(case: Case, lay: Layout, in_place: bool, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds per call, wrong elements) on this rank; NaN for either when it does not apply."""
    if in_place and not case.impl.in_place(case.coll):
        return math.nan, math.nan
    bufs = make_buffers(case.coll, lay, case.op, hvd.rank(), hvd.size(), case.dtype, case.device, in_place)
    seconds = time_calls(case, bufs, in_place, args.iters, bool(args.blocking))
    wrong = float(check_call(case, lay, in_place)) if args.check else math.nan
    return seconds, wrong


def warm_up(case: Case, sizes: Sequence[int], iters: int) -> None:
    """nccl-tests' warm-up: ``iters`` out-of-place calls at the largest, then the smallest size."""
    elsize = torch.empty((), dtype=case.dtype).element_size()
    for nbytes in (sizes[-1], sizes[0]):
        lay = layout(case.coll, nbytes, elsize, hvd.size())
        bufs = make_buffers(case.coll, lay, case.op, hvd.rank(), hvd.size(), case.dtype, case.device, False)
        for _ in range(iters):
            call(case, bufs, False)
        synchronize(case.device)


# ---------------------------------------------------------------------------------------------
# rows, tables and the job's agreement on them


@dataclass
class Result:
    time_us: float
    algbw: float
    busbw: float
    wrong: float | None  # None: not checked (-c 0)

    def as_json(self) -> dict[str, Any]:
        return {"time_us": self.time_us, "algbw": self.algbw, "busbw": self.busbw, "wrong": self.wrong}


@dataclass
class Row:
    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Result | None
    in_place: Result | None
    errors: int = 0  # (rank, place) pairs with wrong elements: nccl-tests' "Out of bounds values"

    def as_json(self, coll: str, impl: str) -> dict[str, Any]:
        """One entry of the JSON's ``results``; a place that does not apply (N/A) is an empty object."""
        return {"collective": coll, "impl": impl, "bytes": self.size, "count": self.count, "type": self.type,
                "redop": self.redop, "root": self.root,
                "out_of_place": self.out_of_place.as_json() if self.out_of_place else {},
                "in_place": self.in_place.as_json() if self.in_place else {}}


@dataclass
class Table:
    coll: str
    impl: str
    label: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # gpucomm's counters moved by the timed calls

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.rows)

    @property
    def avg_busbw(self) -> float | None:
        """nccl-tests' "Avg bus bandwidth" over every timed cell; None when the table has no rows."""
        return self.average("busbw")

    @property
    def avg_algbw(self) -> float | None:
        return self.average("algbw")

    def average(self, metric: str) -> float | None:
        values = [getattr(res, metric) for r in self.rows for res in (r.out_of_place, r.in_place) if res is not None]
        values = [v for v in values if math.isfinite(v)]
        return sum(values) / len(values) if values else None

    @property
    def empty_reason(self) -> str:
        """Why the table has no rows (only meaningful when it has none)."""
        if self.skipped:
            return "every case skipped: " + "; ".join(self.skipped)
        return "no size in the sweep leaves an element per rank (raise -b or -e)"


def agree(seconds: Sequence[float], wrong: Sequence[float], mode: int) -> tuple[list[float], list[float], int]:
    """Every rank's (time, wrong) per place, reduced the same way on every rank: time by ``mode``
    (nccl-tests' -a), #wrong summed; plus the number of (rank, place) pairs that saw wrong elements."""
    mine = torch.tensor([list(seconds) + list(wrong)], dtype=torch.float64)
    every = hvd.allgather(mine)  # (ranks, 2 * places), CPU tensor: Gloo, whatever the benchmark's device
    k = len(seconds)
    times = every[:, :k]
    pick = {0: lambda t: t[0], 1: lambda t: t.mean(0), 2: lambda t: t.amin(0), 3: lambda t: t.amax(0)}[mode]
    wrongs = every[:, k:]
    errors = int((wrongs.nan_to_num(0) > 0).sum())
    return pick(times).tolist(), wrongs.sum(0).tolist(), errors


def make_result(coll: str, lay: Layout, elsize: int, seconds: float, wrong: float, checked: bool) -> Result | None:
    if math.isnan(seconds):
        return None
    algbw, busbw = bandwidth(coll, lay.paramcount, elsize, hvd.size(), seconds)
    return Result(seconds * 1e6, algbw, busbw, wrong if checked else None)


def run_row(case: Case, nbytes: int, args: argparse.Namespace) -> Row | None:
    elsize = torch.empty((), dtype=case.dtype).element_size()
    lay = layout(case.coll, nbytes, elsize, hvd.size())
    if lay.paramcount == 0:
        return None
    oop = measure(case, lay, False, args)
    ip = measure(case, lay, True, args)
    times, wrongs, errors = agree([oop[0], ip[0]], [oop[1], ip[1]], args.average)
    results = [make_result(case.coll, lay, elsize, t, w, bool(args.check)) for t, w in zip(times, wrongs)]
    return Row(max(lay.sendcount, lay.recvcount) * elsize, lay.paramcount, case.dtype_name, case.op, case.root,
               results[0], results[1], errors)


# -- printing (nccl-tests' formats, src/common.cu) ----------------------------------------------
def format_time(us: float) -> str:
    return f"{us:7.0f}" if us >= 10000.0 else f"{us:7.1f}" if us >= 100.0 else f"{us:7.2f}"


def format_row(row: Row) -> str:
    line = f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}"
    for res in (row.out_of_place, row.in_place):
        if res is None:
            line += f"  {NA:>7s}  {NA:>6s}  {NA:>6s}  {NA:>5s}"
        else:
            wrong = NA if res.wrong is None else f"{res.wrong:g}"
            line += f"  {format_time(res.time_us)}  {res.algbw:6.2f}  {res.busbw:6.2f}  {wrong:>5s}"
    return line


def table_header() -> list[str]:
    return [
        "#",
        f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}           out-of-place                       in-place",
        f"# {'size':>10s}  {'count':>12s}  {'type':>8s}  {'redop':>6s}  {'root':>6s}  {'time':>7s}  {'algbw':>6s}  "
        f"{'busbw':>6s} {'#wrong':>6s}  {'time':>7s}  {'algbw':>6s}  {'busbw':>6s} {'#wrong':>6s}",
        f"# {'(B)':>10s}  {'(elements)':>12s}  {'':>8s}  {'':>6s}  {'':>6s}  {'(us)':>7s}  {'(GB/s)':>6s}  "
        f"{'(GB/s)':>6s}  {'':>5s}  {'(us)':>7s}  {'(GB/s)':>6s}  {'(GB/s)':>6s}",
    ]


def table_footer(table: Table) -> list[str]:
    avg = fmt(table.avg_busbw, "g") if table.rows else f"{NOT_AVAILABLE} (no rows: {table.empty_reason})"
    return [f"# Out of bounds values : {table.errors} {'FAILED' if table.errors else 'OK'}",
            f"# Avg bus bandwidth    : {avg}", "#"]


def summary_metric(nranks: int) -> str:
    """What the summary averages: busbw, except at 1 rank, where nccl-tests' factor makes it 0 for
    every collective but broadcast, so algbw is the number that says anything."""
    return "busbw" if nranks > 1 else "algbw"


def summary_cell(table: Table, metric: str) -> str:
    value = table.average(metric) if table.rows else None
    return f"{table.coll}/{table.impl} {fmt(value, '.3g')}"


def summary_lines(tables: Sequence[Table], nranks: int, not_measured: dict[str, str]) -> list[str]:
    """The closing summary: average bandwidth per table (n/a for an empty one, with the reason on a
    line of its own), the implementations that were not measured and why, and the out-of-bounds total."""
    metric = summary_metric(nranks)
    what = ("avg bus bandwidth (GB/s)" if metric == "busbw" else
            "avg algorithm bandwidth (GB/s; at 1 rank nccl-tests' busbw is 0 for all but broadcast)")
    cells = ", ".join(summary_cell(t, metric) for t in tables) or f"{NOT_AVAILABLE} (no tables were run)"
    lines = [f"# Summary: {what}: {cells}"]
    empty: dict[str, list[str]] = {}
    for t in tables:
        if not t.rows:
            empty.setdefault(t.empty_reason, []).append(f"{t.coll}/{t.impl}")
    lines += [f"# No rows for {', '.join(names)}: {reason}" for reason, names in empty.items()]
    lines += [f"# Not measured: {name}: {reason}" for name, reason in not_measured.items()]
    failed = sum(t.errors for t in tables)
    lines.append(f"# Out of bounds values (all tables) : {failed} {'FAILED' if failed else 'OK'}")
    return lines


def ratio_lines(tables: Sequence[Table], metric: str) -> list[str]:
    """gpucomm's bandwidth over torch.distributed's, per collective and place, for rows of equal
    size, type, op and root (the comparison the README quotes); none when either is missing."""
    by = {(t.coll, t.impl): t for t in tables}
    cells = []
    for coll in dict.fromkeys(t.coll for t in tables):
        ours, theirs = by.get((coll, "gpucomm")), by.get((coll, "torch"))
        if ours is None or theirs is None:
            continue
        keys = {(r.size, r.count, r.type, r.redop, r.root) for r in ours.rows}
        plain = len({(k[2], k[3], k[4]) for k in keys}) == 1  # one type, op and root: the size says which row
        same = {(r.size, r.count, r.type, r.redop, r.root): r for r in theirs.rows}
        for a in ours.rows:
            b = same.get((a.size, a.count, a.type, a.redop, a.root))
            if b is None:  # torch skipped this case (e.g. Gloo's integer average)
                continue
            what = f"{a.size} B" if plain else f"{a.size} B {a.type} {a.redop} root {a.root}"
            for place in ("out_of_place", "in_place"):
                x, y = getattr(a, place), getattr(b, place)
                if x is not None and y is not None and getattr(y, metric) > 0:
                    cells.append(f"{coll} {place.replace('_', '-')} {what} {getattr(x, metric) / getattr(y, metric):.2f}")
    return [f"# gpucomm / torch.distributed {metric}: " + ", ".join(cells)] if cells else []


def say(*lines: str) -> None:
    if hvd.rank() == 0:
        for line in lines:
            print(line.rstrip(), flush=True)


# ---------------------------------------------------------------------------------------------
# the sweep


def cases_for(coll: str, impl: Impl, args: argparse.Namespace, device: torch.device):
    ops = args.ops_list if coll in REDUCING else ["none"]
    roots = (range(hvd.size()) if args.root == -1 else [args.root]) if coll == "broadcast" else [-1]
    for dtype_name in args.dtype_list:
        for op in ops:
            for root in roots:
                yield Case(coll, impl, dtype_name, op, root, device)


def run_table(table: Table, impl: Impl, sizes: Sequence[int], args: argparse.Namespace, device: torch.device) -> None:
    """Fill ``table`` row by row (so an interrupted sweep keeps the rows it measured)."""
    coll = table.coll
    say(f"# Collective {coll}, implementation {impl.name}: {impl.label}, {impl.api(coll)}; "
        f"device {device_text(device)}, {hvd.size()} ranks", *table_header())
    for case in cases_for(coll, impl, args, device):
        reason = impl.unsupported(coll, case.dtype, case.op)
        if reason:
            table.skipped.append(f"{case.dtype_name} {case.op}: {reason}")
            say(f"# skipped {case.dtype_name} {case.op}: {reason}")
            continue
        warm_up(case, sizes, args.warmup_iters)
        for nbytes in sizes:
            row = run_row(case, nbytes, args)
            anchors.add_counts(table.counters, case.counters)
            case.counters.clear()
            if row is not None:
                table.rows.append(row)
                say(format_row(row))
    say(*table_footer(table))


def _stop(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_sweep(tables: list[Table], impls: Sequence[Impl], sizes: Sequence[int], args: argparse.Namespace,
              device: torch.device) -> bool:
    """Every table, appended to ``tables`` before its rows fill in; False when SIGINT or SIGTERM (the
    launcher stopping the job: Ctrl-C, or another rank failing) cut the sweep short. With
    ``--rounds R`` the sweep runs R times, each round every implementation's table in turn, and
    ``tables`` ends with the median of the rounds (``median_tables``)."""
    previous = signal.signal(signal.SIGTERM, _stop)
    rounds: list[list[Table]] = []
    try:
        for r in range(args.rounds):
            rounds.append([])
            if args.rounds > 1:
                say(f"# round {r + 1} of {args.rounds}")
            for coll in args.collectives:
                for impl in impls:
                    rounds[-1].append(Table(coll, impl.name, impl.label))
                    if args.rounds == 1:
                        tables.append(rounds[-1][-1])
                    run_table(rounds[-1][-1], impl, sizes, args, device)
    except KeyboardInterrupt:
        if args.rounds > 1 and len(rounds) > 1:  # the medians of the rounds that finished
            tables.extend(median_tables(rounds[:-1]))
            say(f"# Interrupted in round {len(rounds)}: the tables kept are the medians of the {len(rounds) - 1} "
                f"rounds that finished")
        elif args.rounds > 1 and rounds:
            tables.extend(rounds[-1])  # the first round, as far as it got
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.rounds > 1:
        tables.extend(median_tables(rounds))
        say(f"# Median of {args.rounds} interleaved rounds (time per call; bandwidths from that time)")
        for table in tables:
            say(f"# Collective {table.coll}, implementation {table.impl}: {table.label}", *table_header(),
                *(format_row(row) for row in table.rows), *table_footer(table))
    return True


def _median_result(results: Sequence[Result | None]) -> Result | None:
    kept = [r for r in results if r is not None and math.isfinite(r.time_us) and r.time_us > 0]
    if not kept:
        return results[0]
    t = median([r.time_us for r in kept])
    scale = kept[0].time_us / t  # bandwidth is bytes / time: rescale one round's to the median time
    wrongs = [r.wrong for r in kept if r.wrong is not None]
    return Result(t, kept[0].algbw * scale, kept[0].busbw * scale, max(wrongs) if wrongs else None)


def median_tables(rounds: Sequence[Sequence[Table]]) -> list[Table]:
    """One table per (collective, implementation): each cell's median time over the rounds (each
    round has the same tables in the same order, with the same rows); #wrong and errors the worst."""
    merged = []
    shape = [(t.coll, t.impl, len(t.rows)) for t in rounds[0]]
    if any([(t.coll, t.impl, len(t.rows)) for t in r] != shape for r in rounds):
        raise ValueError("median_tables: the rounds differ in their tables or rows; every round must run the same sweep")
    for same in zip(*rounds):
        first = same[0]
        table = Table(first.coll, first.impl, first.label, skipped=list(first.skipped))
        for t in same:
            anchors.add_counts(table.counters, t.counters)
        for rows in zip(*(t.rows for t in same)):
            r0 = rows[0]
            table.rows.append(Row(r0.size, r0.count, r0.type, r0.redop, r0.root,
                                  _median_result([r.out_of_place for r in rows]),
                                  _median_result([r.in_place for r in rows]), max(r.errors for r in rows)))
        merged.append(table)
    return merged


def device_text(device: torch.device) -> str:
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_record(device: torch.device) -> dict[str, Any]:
    """This rank's place, for the "Using devices" lines and the JSON."""
    rec: dict[str, Any] = {"rank": hvd.rank(), "pid": os.getpid(), "host": socket.gethostname()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        rec.update(device=f"{device.index}", bus_id=f"0x{bus:02x}" if isinstance(bus, int) else "?", name=props.name)
    else:
        rec.update(device="cpu", bus_id=f"{os.cpu_count()} cores", name=cpu_model())
    return rec


def environment(device: torch.device, impls: Sequence[Impl], devices: list[dict[str, Any]]) -> dict[str, Any]:
    nccl = nccl_module()
    env: dict[str, Any] = {
        "ranks": hvd.size(), "device": device.type, "devices": devices, "python": platform.python_version(),
        "torch": torch.__version__, "gpucomm": gpucomm.__version__, "platform": platform.platform(),
        "implementations": {i.name: i.label for i in impls},
        "nccl": version_text(nccl.get_version()) if nccl is not None else None,
        "single_gpu_test": os.environ.get("GPUCOMM_SINGLE_GPU_TEST", "") not in ("", "0"),
    }
    try:
        import cupy  # noqa: PLC0415

        env["cupy"] = cupy.__version__
    except Exception:  # no CuPy, or one that cannot find CUDA: the CPU sweep does not need it
        env["cupy"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["torch_cuda"] = torch.version.cuda
        env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        env["device_name"] = cpu_model()
    return env


def preamble(args: argparse.Namespace, devices: list[dict[str, Any]]) -> list[str]:
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [f"# nRanks {hvd.size()} minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
             f"warmup iters: {args.warmup_iters} iters: {args.iters} agg iters: 1 validation: {args.check} graph: 0",
             f"# Time: {AVERAGE_MODES[args.average]} (-a {args.average})"]
    if args.blocking:
        lines.append("# Blocking Enabled: wait for completion and barrier after each collective")
    lines += ["#", "# Using devices"]
    lines += [f"#  Rank {d['rank']:2d} Pid {d['pid']:6d} on {d['host']:>10s} device {d['device']:>3s} [{d['bus_id']}] "
              f"{d['name']}" for d in devices]
    return lines


# ---------------------------------------------------------------------------------------------
# output files


def write_json(path: str, tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> None:
    """Every row of every table as one flat ``results`` list (times in us, bandwidths in GB/s of 1e9 B),
    plus one summary per table and the environment. Strict JSON: a bandwidth that is not finite is null;
    an empty table has null averages and says why in ``empty_reason``."""
    doc = {"benchmark": "collectives", "units": {"time_us": "us", "algbw": "GB/s", "busbw": "GB/s"},
           "env": env, "args": vars(args),
           "results": [r.as_json(t.coll, t.impl) for t in tables for r in t.rows],
           "tables": [{"collective": t.coll, "impl": t.impl, "label": t.label, "rows": len(t.rows),
                       "skipped": t.skipped, "out_of_bounds": t.errors, "avg_busbw": t.avg_busbw,
                       "avg_algbw": t.avg_algbw, "empty_reason": None if t.rows else t.empty_reason,
                       "counters": t.counters}
                      for t in tables]}
    write_strict_json(path, doc)


def _size_label(nbytes: float, _pos=None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def write_plot(path: str, tables: Sequence[Table], title: str, metric: str = "busbw") -> bool:
    """``metric`` (busbw, or algbw at 1 rank) against size, one panel per collective, one line per
    implementation (in-place dashed). Returns False, after saying why, when matplotlib is missing or
    no table has a row to draw."""
    if not any(t.rows for t in tables):
        print(f"# plot skipped: no table has a row to draw, so {path} was not written", flush=True)
        return False
    try:
        import matplotlib  # noqa: PLC0415 - optional: only the plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    except ImportError:
        print(f"# plot skipped: matplotlib is not installed (pip install matplotlib), so {path} was not written",
              flush=True)
        return False
    colls = list(dict.fromkeys(t.coll for t in tables))
    cols = min(3, len(colls))
    rows = math.ceil(len(colls) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(IMPLS)}
    for ax, coll in zip(axes.flat, colls):
        for t in (t for t in tables if t.coll == coll):
            _plot_table(ax, t, colors.get(t.impl, "k"), metric)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
        ax.set_title(coll)
        ax.set_xlabel("size (B)")
        ax.set_ylabel(f"{metric} (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(colls):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_table(ax, table: Table, color: str, metric: str) -> None:
    series = list(dict.fromkeys((r.type, r.redop, r.root) for r in table.rows))
    for key in series:
        rows = [r for r in table.rows if (r.type, r.redop, r.root) == key]
        tag = "" if len(series) == 1 else " " + " ".join(str(k) for k in key if k not in ("none", -1))
        for place, style in (("out_of_place", "-o"), ("in_place", "--")):
            pts = [(r.size, getattr(getattr(r, place), metric)) for r in rows
                   if getattr(r, place) is not None and math.isfinite(getattr(getattr(r, place), metric))]
            if pts:
                suffix = "" if place == "out_of_place" else " in-place"
                ax.plot(*zip(*pts), style, color=color, markersize=3, label=f"{table.impl}{tag}{suffix}")


# ---------------------------------------------------------------------------------------------
# command line


def _csv(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none given)'}; choose from "
                                             f"{', '.join(choices)} (comma-separated)")
        return items
    return parse


def _dtypes(text: str) -> list[str]:
    if text == "all":
        return list(DTYPES)
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown datatype {text!r}; choose from {', '.join(DTYPES)}, all "
                                         f"(aliases: {', '.join(DTYPE_ALIASES)})")
    return [name]


def _ops(text: str) -> list[str]:
    if text == "all":
        return list(OPS)
    if text not in OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}; choose from {', '.join(OPS)}, all")
    return [text]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--minbytes", type=parse_size, help="smallest size (default 8)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, help="largest size (default 32M on cuda, 4M on cpu)")
    ap.add_argument("-f", "--stepfactor", type=int, help="multiply the size by this (default 2)")
    ap.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20, help="add this when -f is 1 (default 1M)")
    ap.add_argument("-w", "--warmup_iters", type=int, help="warm-up calls (default 5)")
    ap.add_argument("-n", "--iters", type=int, help="timed calls per size (default 20)")
    ap.add_argument("-R", "--rounds", type=int, default=1,
                    help="run the sweep this many times, the implementations' tables in turn each round, and "
                         "report each cell's median: interleaved, so load that drifts during the run is shared "
                         "(default 1: nccl-tests' single pass)")
    ap.add_argument("-z", "--blocking", type=int, choices=(0, 1), default=0,
                    help="1: wait for completion and run a barrier after each call")
    ap.add_argument("-d", "--datatype", dest="dtype_list", type=_dtypes, default=["float"],
                    help="int8, uint8, int32, int64, half, float, double, bfloat16 or all (default float)")
    ap.add_argument("-o", "--op", dest="ops_list", type=_ops, default=["sum"],
                    help="sum, prod, max, min, avg or all (default sum; reducing collectives only)")
    ap.add_argument("-r", "--root", type=int, default=0, help="broadcast's root; -1 runs every root (default 0)")
    ap.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check results (default 1)")
    ap.add_argument("-a", "--average", type=int, choices=(0, 1, 2, 3), default=1,
                    help="time reported: 0 rank 0's, 1 average over ranks, 2 minimum, 3 maximum (default 1)")
    ap.add_argument("--ops", dest="collectives", type=_csv(COLLECTIVES, "collective"), default=list(COLLECTIVES),
                    help="collectives to run (default: all five)")
    ap.add_argument("--impls", type=_csv(IMPLS, "implementation"), default=None,
                    help="gpucomm, nccl, torch (default: those available on the device)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--cpu-operations", choices=("auto", "gloo", "mpi"), default="auto",
                    help="gpucomm's transport for CPU tensors (GPUCOMM_CPU_OPERATIONS): auto (default: MPI under an "
                         "MPI launcher with mpi4py, else Gloo), gloo, or mpi (needs gpucomm-run --mpi, mpiexec or "
                         "mpirun); torch.distributed stays on Gloo")
    ap.add_argument("--json", default="bench-out/collectives.json", help="results file ('' to skip)")
    ap.add_argument("--plot", default="bench-out/collectives.png", help="PNG plot ('' to skip)")
    ap.add_argument("--quick", action="store_true", help="a tiny sweep for tests: 8 B .. 64K by 8x, -w 1 -n 2")
    return ap


def fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the device or on --quick; explicit flags always win."""
    quick = {"minbytes": 8, "maxbytes": 64 << 10, "stepfactor": 8, "warmup_iters": 1, "iters": 2}
    full = {"minbytes": 8, "maxbytes": (32 << 20) if args.device == "cuda" else (4 << 20), "stepfactor": 2,
            "warmup_iters": 5, "iters": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


class UsageError(Exception):
    """A request this job cannot run; main() prints it on one line and exits with status 2."""


def validate(args: argparse.Namespace) -> None:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda needs a CUDA GPU and a CUDA build of torch, but torch.cuda.is_available() "
                         f"is False (torch {torch.__version__}); run with --device cpu, or on a GPU machine.")
    fill_defaults(args)
    if args.minbytes > args.maxbytes:
        raise UsageError(f"invalid sizes: minbytes {args.minbytes} > maxbytes {args.maxbytes}")
    if args.stepfactor < 1 or args.iters < 1 or args.warmup_iters < 0 or args.stepbytes < 1 or args.rounds < 1:
        raise UsageError("-f and -i must be at least 1, -n and -R at least 1 and -w at least 0")
    if args.minbytes < 1:
        raise UsageError("-b must be at least 1 byte")
    if args.impls is not None:
        for name in args.impls:
            reason = unavailable(name, args.device)
            if reason:
                raise UsageError(f"--impls {name}: {reason}")


def unavailable(name: str, device: str) -> str | None:
    """Why implementation ``name`` cannot run on ``device`` (None when it can)."""
    if name == "nccl":
        if device != "cuda":
            return "raw NCCL moves CUDA buffers only; use --device cuda (or leave nccl out on CPU)"
        if nccl_module() is None:
            return ("CuPy's NCCL bindings could not be loaded; install gpucomm's CUDA extra "
                    "(pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]')")
    if name == "torch":
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if device == "cuda" and not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
        if device == "cpu" and not dist.is_gloo_available():
            return "this torch build has no Gloo backend"
    return None


def not_measured(names: Sequence[str] | None, device: str) -> dict[str, str]:
    """The implementations left out of a default run (no --impls), each with the reason."""
    if names is not None:
        return {}
    reasons = {n: unavailable(n, device) for n in IMPLS}
    return {n: r for n, r in reasons.items() if r}


def make_impls(names: Sequence[str] | None, device: torch.device) -> list[Impl]:
    """Build the implementations in a fixed order (each builds collectively: every rank, same order)."""
    chosen = [n for n in IMPLS if (names is None and unavailable(n, device.type) is None) or (names and n in names)]
    impls: list[Impl] = []
    for name in chosen:
        if name == "gpucomm":
            impls.append(GpucommImpl())
        elif name == "torch":
            impls.append(TorchImpl(device))
        elif name == "nccl":
            impls.append(NcclImpl(nccl_module()))
    return impls


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
    except UsageError as e:
        print(f"collectives.py: error: {e}", file=sys.stderr)
        return 2
    if args.cpu_operations != "auto":
        os.environ["GPUCOMM_CPU_OPERATIONS"] = args.cpu_operations
    sockets = anchors.tune_sockets()  # before NCCL starts: gpucomm's, raw NCCL's and torch's all read them
    hvd.init()
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # gpucomm pinned this rank's GPU
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    if args.root >= hvd.size() or args.root < -1:
        if hvd.rank() == 0:
            print(f"collectives.py: error: -r {args.root} is not a rank of this {hvd.size()}-rank job; give 0.."
                  f"{hvd.size() - 1}, or -1 for every root", file=sys.stderr)
        hvd.shutdown()
        return 2
    devices = hvd.allgather_object(device_record(device), name="bench.devices")
    impls = make_impls(args.impls, device)
    sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    say("# gpucomm collectives benchmark (nccl-tests tables)", *preamble(args, devices))
    if sockets["single_gpu_test"]:
        say(f"# {anchors.socket_text(sockets)}")
    tables: list[Table] = []
    finished = run_sweep(tables, impls, sizes, args, device)
    env = environment(device, impls, devices)
    env["not_measured"] = not_measured(args.impls, device.type)
    env["cpu_operations"] = cpu_transport(args.cpu_operations)
    env["nccl_sockets"] = sockets
    env["gpucomm_counters"] = counter_record(tables)
    env["interrupted"] = not finished
    if not finished:
        return report_interrupted(tables, env, args)
    for impl in reversed(impls):
        impl.close()
    if hvd.rank() == 0:
        report(tables, env, args)
    hvd.barrier()  # a failing exit status on another rank would make the launcher stop rank 0 mid-write
    hvd.shutdown()
    return 1 if sum(t.errors for t in tables) else 0


def cpu_transport(asked: str) -> dict[str, Any]:
    """What ``--cpu-operations`` asked for and the CPU collectives gpucomm ran on each transport
    (``hvd.stats()``: the proof of which one carried the sweep's data)."""
    counts = hvd.stats()
    return {"asked": asked, "collectives": {"gloo": counts["gloo_collectives"], "mpi": counts["mpi_collectives"]}}


def counter_record(tables: Sequence[Table]) -> dict[str, Any]:
    """gpucomm's counters (``hvd.stats()``) moved by the timed calls of its tables, summed, and the
    counters this gpucomm does not have (they read 0): which paths its calls took."""
    total: dict[str, int] = {}
    for t in tables:
        if t.impl == "gpucomm":
            anchors.add_counts(total, t.counters)
    have = hvd.stats()
    return {"timed_calls": total, "not_in_this_gpucomm": [c for c in anchors.COUNTERS if c not in have]}


def counter_line(record: dict[str, Any]) -> str:
    moved = ", ".join(f"{k} {v}" for k, v in record["timed_calls"].items() if v) or "none"
    missing = record["not_in_this_gpucomm"]
    return (f"# gpucomm counters moved by its timed calls (every table, rank 0): {moved}"
            + (f" (not in this gpucomm: {', '.join(missing)})" if missing else ""))


def report(tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> None:
    """Rank 0's summary, JSON and plot."""
    say(*summary_lines(tables, hvd.size(), env["not_measured"]))
    say(*ratio_lines(tables, summary_metric(hvd.size())))
    say(counter_line(env["gpucomm_counters"]))
    ran = env["cpu_operations"]["collectives"]
    if ran["gloo"] or ran["mpi"]:
        say(f"# gpucomm's CPU collectives on rank 0 (--cpu-operations {env['cpu_operations']['asked']}): "
            f"gloo {ran['gloo']}, mpi {ran['mpi']}")
    if env["interrupted"]:
        say("# Interrupted: the sweep was stopped; the tables above hold the rows measured before that")
    if args.json:
        write_json(args.json, tables, env, args)
        print(f"# wrote {args.json}", flush=True)
    metric = summary_metric(hvd.size())
    title = f"{'bus' if metric == 'busbw' else 'algorithm'} bandwidth, {hvd.size()} ranks, {env['device_name']}"
    if args.plot and write_plot(args.plot, tables, title, metric):
        print(f"# wrote {args.plot}", flush=True)


def report_interrupted(tables: Sequence[Table], env: dict[str, Any], args: argparse.Namespace) -> int:
    """After SIGINT/SIGTERM: rank 0 reports what it has, then every rank leaves at once (status 130).
    No collective can run any more (the other ranks are stopping too), so gpucomm's shutdown, which
    talks to them, is skipped."""
    if hvd.rank() == 0:
        report(tables, env, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
