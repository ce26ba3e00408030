"""Framework-neutral collectives: requests, argument checks, and how each one runs on a backend.

A ``Request`` is validated on the caller's thread (so bad input raises there, at once) and then
issued in submission order by the engine. CPU requests run on Gloo and finish on the waiting
thread; CUDA requests run on NCCL on a communication stream that waits on an event recorded on
the caller's stream, so they never block the host.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .backends.base import WireOp
from .engine import Issued
from .errors import CollectiveError


class ReduceOp(enum.IntEnum):
    """Horovod's reduction codes (hvd.Average == 0 ... hvd.Product == 5)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


# What each kind of collective accepts. Horovod reduces int32/int64/float16/float32/float64; we add
# bfloat16, uint8 and int8 (both backends reduce them). Data movement takes any fixed-size dtype.
REDUCIBLE = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
MOVABLE = REDUCIBLE + (torch.bool, torch.int16)
_REDUCIBLE_SET, _MOVABLE_SET = frozenset(REDUCIBLE), frozenset(MOVABLE)
_DTYPE_CODE = {dt: i for i, dt in enumerate(MOVABLE)}
_WIRE = {ReduceOp.SUM: WireOp.SUM, ReduceOp.MIN: WireOp.MIN, ReduceOp.MAX: WireOp.MAX, ReduceOp.PRODUCT: WireOp.PRODUCT}


@dataclass(eq=False)
class Request:
    """One collective as submitted: the same fields on every rank for the same call."""

    kind: str  # allreduce | allgather | broadcast | alltoall | reducescatter | barrier
    name: str
    tensors: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None  # in-place targets; None = allocate results
    op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = 0
    splits: list[int] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ready_event: Any = None  # CUDA: recorded on the caller's stream when submitted

    def describe(self) -> str:
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self.tensors[:3])
        more = f" (+{len(self.tensors) - 3} more)" if len(self.tensors) > 3 else ""
        return f"{self.kind} '{self.name}' of [{shapes}{more}] on {self.device}"

    @property
    def needs_exchange(self) -> bool:
        """True when issuing must first learn other ranks' shapes (it blocks on the network)."""
        return self.kind in ("allgather", "alltoall")


# ---------------------------------------------------------------------------------------------
# validation (caller's thread)


def check_tensors(kind: str, tensors: Sequence[torch.Tensor], *, reducing: bool) -> torch.device:
    """Validate dtype, layout and device; return the common device."""
    if not tensors:
        raise ValueError(f"{kind} needs at least one tensor")
    allowed = _REDUCIBLE_SET if reducing else _MOVABLE_SET
    device = tensors[0].device
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kind} expects torch tensors, got {type(t).__name__}")
        if t.is_sparse:
            raise ValueError(f"{kind}: sparse tensors are not supported; densify with .to_dense() first.")
        if not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
        if t.dtype not in allowed:
            raise ValueError(f"Tensor type {t.dtype} is not supported by {kind}; supported: "
                             + ", ".join(str(d).replace("torch.", "") for d in (REDUCIBLE if reducing else MOVABLE)) + ".")
        if t.device != device:
            raise ValueError(f"{kind}: all tensors of one call must be on one device, got {device} and {t.device}.")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{kind}: tensors must be on the CPU or a CUDA device, got {device}.")
    return device


def check_op(kind: str, op: ReduceOp) -> None:
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(f"{kind} with op=Adasum is not supported by gpucomm; use hvd.Average or hvd.Sum.")
    if op not in ReduceOp.__members__.values():
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product.")


def equal_splits(rows: int, size: int, what: str) -> list[int]:
    if rows % size:
        raise ValueError(f"{what}: dim 0 ({rows}) must divide evenly by the number of ranks ({size}) when no "
                         f"splits are given; pass splits= to send uneven parts.")
    return [rows // size] * size


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's rule: ``rows // size`` each, the first ``rows % size`` ranks one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


# ---------------------------------------------------------------------------------------------
# scaling


def scale_(t: torch.Tensor, factor: float) -> None:
    """Multiply in place: integers through float64 then truncation (Horovod's rule); half types
    through float32 on the CPU."""
    if factor == 1.0 or t.numel() == 0:
        return
    if not t.dtype.is_floating_point:
        divisor = 1.0 / factor
        if divisor == round(divisor) or abs(divisor - round(divisor)) < 1e-9 * abs(divisor):
            # an average: divide exactly (49 * (1/49) in float64 is just under 1 and would truncate to 0)
            t.copy_(torch.div(t, int(round(divisor)), rounding_mode="trunc"))
        else:
            t.copy_((t.double() * factor).to(t.dtype))
    elif t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float().mul_(factor))
    else:
        t.mul_(factor)


def _prod(dims: Sequence[int]) -> int:
    return math.prod(dims) if dims else 1


# ---------------------------------------------------------------------------------------------
# execution (engine's issuing thread)

Plan = tuple[list[Any], Callable[[], Any]]  # backend works, and the step that produces the result


class Executor:
    """Turns requests into backend calls for one initialized job."""

    def __init__(self, rank: int, size: int, gloo, nccl_factory: Callable[[], Any], *, timeout: float) -> None:
        self.rank, self.size, self._timeout = rank, size, timeout
        self._gloo = gloo
        self._nccl_factory = nccl_factory
        self._streams: dict[int, Any] = {}

    def __call__(self, req: Request) -> Issued:
        if req.device.type == "cpu" or req.kind == "barrier":
            works, after = self._plan(req, self._gloo, None)
            return Issued(works, None, after)
        backend = self._nccl_factory()
        comm = self._comm_stream(req.device)
        comm.wait_event(req.ready_event)
        with torch.cuda.stream(comm):
            works, after = self._plan(req, backend, comm.cuda_stream)
            result = after()
            done = torch.cuda.Event()
            done.record(comm)
        for t in req.tensors + (req.outputs or []):
            t.record_stream(comm)  # the caching allocator must not reuse them while NCCL runs
        return Issued(works, done, lambda: result)

    def _comm_stream(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def _plan(self, req: Request, backend, stream: int | None) -> Plan:
        return getattr(self, "_" + req.kind)(req, backend, stream)

    # -- metadata exchange -------------------------------------------------------------------
    def _exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's integer vector (lengths may differ), through Gloo."""
        n = torch.tensor([len(values)], dtype=torch.int64)
        lengths = torch.empty(self.size, dtype=torch.int64)
        self._gloo.allgather(n, lengths).wait(self._timeout)
        width = int(lengths.max())
        mine = torch.zeros(width, dtype=torch.int64)
        mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
        every = torch.empty(self.size * width, dtype=torch.int64)
        self._gloo.allgather(mine, every).wait(self._timeout)
        rows = every.view(self.size, width).tolist()
        return [row[: int(lengths[r])] for r, row in enumerate(rows)]

    def _shapes_everywhere(self, req: Request, extra: Sequence[int] = ()) -> list[list[list[int]]]:
        """Each rank's (dtype code, shape) per tensor; raise on every rank when dtypes, ranks of
        shape or trailing dimensions differ, since no data can move then."""
        mine: list[int] = [len(req.tensors)]
        for t in req.tensors:
            mine += [_DTYPE_CODE[t.dtype], t.dim(), *t.shape]
        mine += list(extra)
        every = self._exchange(mine)
        parsed = []
        for r, vec in enumerate(every):
            count, pos, shapes = vec[0], 1, []
            for _ in range(count):
                code, ndim = vec[pos], vec[pos + 1]
                shapes.append([code, *vec[pos + 2 : pos + 2 + ndim]])
                pos += 2 + ndim
            parsed.append(shapes + [vec[pos:]])
        ref = parsed[self.rank]
        for r, shapes in enumerate(parsed):
            if len(shapes) != len(ref):
                raise CollectiveError(f"{req.describe()}: rank {r} passed {len(shapes) - 1} tensors but rank "
                                      f"{self.rank} passed {len(ref) - 1}; every rank must pass the same number.")
            for i, (a, b) in enumerate(zip(shapes[:-1], ref[:-1])):
                if a[0] != b[0] or len(a) != len(b) or a[2:] != b[2:]:
                    raise CollectiveError(
                        f"Mismatched {req.kind.upper()} tensor shapes or types for tensor {i} of '{req.name}': rank "
                        f"{r} sent {MOVABLE[a[0]]} of shape {a[1:]}, rank {self.rank} sent {MOVABLE[b[0]]} of shape "
                        f"{b[1:]}. All ranks must agree on dtype and on every dimension but the first.")
        return parsed

    # -- collectives -------------------------------------------------------------------------
    def _wire(self, req: Request, backend, dtype: torch.dtype) -> tuple[WireOp, float]:
        """The backend reduction and the post-scale that together give ``req.op``."""
        if req.op != ReduceOp.AVERAGE:
            return _WIRE[req.op], req.postscale
        if backend.name == "nccl" and dtype.is_floating_point and req.prescale == 1.0 and req.postscale == 1.0:
            return WireOp.AVG, 1.0
        return WireOp.SUM, req.postscale / self.size

    def _allreduce(self, req: Request, backend, stream) -> Plan:
        outs = req.outputs if req.outputs is not None else [torch.empty_like(t) for t in req.tensors]
        if len(req.tensors) == 1:
            src, out = req.tensors[0], outs[0]  # contiguous: backends need no flat view
            if out is not src:
                out.copy_(src)
            scale_(out, req.prescale)
            wire, post = self._wire(req, backend, out.dtype)
            work = backend.allreduce(out, out, op=wire, stream=stream)

            def after_one():
                scale_(out, post)
                return outs

            return [w for w in (work,) if w is not None], after_one
        # Grouped: one fused buffer per dtype, one backend call each.
        works, fused = [], []
        for dtype in dict.fromkeys(t.dtype for t in req.tensors):
            idx = [i for i, t in enumerate(req.tensors) if t.dtype == dtype]
            buf = torch.cat([req.tensors[i].reshape(-1) for i in idx])
            scale_(buf, req.prescale)
            wire, post = self._wire(req, backend, dtype)
            w = backend.allreduce(buf, buf, op=wire, stream=stream)
            if w is not None:
                works.append(w)
            fused.append((idx, buf, post))

        def after_group():
            for idx, buf, post in fused:
                scale_(buf, post)
                pos = 0
                for i in idx:
                    n = outs[i].numel()
                    outs[i].view(-1).copy_(buf[pos : pos + n])
                    pos += n
            return outs

        return works, after_group

    def _broadcast(self, req: Request, backend, stream) -> Plan:
        src = req.tensors[0]
        out = req.outputs[0] if req.outputs is not None else (src.clone() if self.rank == req.root else torch.empty_like(src))
        work = backend.broadcast(out.view(-1), out.view(-1), root=req.root, stream=stream)
        return [w for w in (work,) if w is not None], lambda: [out]

    def _allgather(self, req: Request, backend, stream) -> Plan:
        parsed = self._shapes_everywhere(req)
        works, pieces = [], []
        for i, t in enumerate(req.tensors):
            rows = [parsed[r][i][1] if len(parsed[r][i]) > 1 else 1 for r in range(self.size)]
            tail = list(t.shape[1:])
            row_numel = _prod(tail)
            most = max(rows)
            send = t.reshape(-1)
            if min(rows) != most:  # uneven first dimension: pad to the longest, compact afterwards
                send = torch.zeros(most * row_numel, dtype=t.dtype, device=t.device)
                send[: t.numel()].copy_(t.reshape(-1))
            recv = torch.empty(self.size * most * row_numel, dtype=t.dtype, device=t.device)
            w = backend.allgather(send, recv, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows, most, row_numel, tail, t.dim() == 0))

        def after():
            outs = []
            for recv, rows, most, row_numel, tail, scalar in pieces:
                if scalar:
                    outs.append(recv.view(self.size))
                elif min(rows) == most:
                    outs.append(recv.view(self.size * most, *tail))
                else:
                    parts = [recv[r * most * row_numel : (r * most + rows[r]) * row_numel] for r in range(self.size)]
                    outs.append(torch.cat(parts).view(sum(rows), *tail))
            return outs, [p[1] for p in pieces]

        return works, after

    def _alltoall(self, req: Request, backend, stream) -> Plan:
        t = req.tensors[0]
        splits = req.splits if req.splits is not None else equal_splits(t.shape[0], self.size, "alltoall")
        parsed = self._shapes_everywhere(req, splits)
        received = [parsed[r][-1][self.rank] for r in range(self.size)]
        tail = list(t.shape[1:])
        row_numel = _prod(tail)
        recv = torch.empty(sum(received) * row_numel, dtype=t.dtype, device=t.device)
        w = backend.alltoall(t.reshape(-1), recv, [s * row_numel for s in splits], [s * row_numel for s in received],
                             stream=stream)
        return [w] if w is not None else [], lambda: (recv.view(sum(received), *tail), received)

    def _reducescatter(self, req: Request, backend, stream) -> Plan:
        works, pieces = [], []
        for t in req.tensors:
            rows = reducescatter_rows(t.shape[0], self.size)
            tail = list(t.shape[1:])
            row_numel, most = _prod(tail), rows[0]
            send = torch.zeros(self.size * most * row_numel, dtype=t.dtype, device=t.device)
            flat, pos = t.reshape(-1), 0
            for r, n in enumerate(rows):  # rank r's rows go to slot r, padded to the longest slot
                send[r * most * row_numel : (r * most + n) * row_numel].copy_(flat[pos : pos + n * row_numel])
                pos += n * row_numel
            scale_(send, req.prescale)
            recv = torch.empty(most * row_numel, dtype=t.dtype, device=t.device)
            wire, post = self._wire(req, backend, t.dtype)
            w = backend.reducescatter(send, recv, op=wire, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows[self.rank], row_numel, tail, post))

        def after():
            outs = []
            for recv, n, row_numel, tail, post in pieces:
                out = recv[: n * row_numel].view(n, *tail)
                scale_(out, post)
                outs.append(out)
            return outs

        return works, after

    def _barrier(self, req: Request, backend, stream) -> Plan:
        return [self._gloo.barrier()], lambda: None
