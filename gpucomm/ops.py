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

import numpy as np
import torch

from .backends.base import WireOp
from .engine import Issued
from .negotiation import Descriptor


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
    set_id: int = 0  # the process set it runs on (0: every rank)
    ranks: tuple[int, ...] | None = None  # add_process_set: the new set's ranks

    def describe(self) -> str:
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self.tensors[:3])
        more = f" (+{len(self.tensors) - 3} more)" if len(self.tensors) > 3 else ""
        return f"{self.kind} '{self.name}' of [{shapes}{more}] on {self.device}"



_DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in MOVABLE}


def descriptor_of(req: Request) -> Descriptor:
    """What ``req``'s rank tells the coordinator about it."""
    return Descriptor(req.kind, req.set_id, tuple(_DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in req.tensors),
                      tuple(tuple(t.shape) for t in req.tensors), req.device.type, int(req.op), req.prescale,
                      req.postscale, req.root, None if req.splits is None else tuple(req.splits), req.ranks)


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
        divisor = exact_divisor(factor)
        if divisor is not None:
            t.copy_(torch.div(t, divisor, rounding_mode="trunc"))
        else:
            t.copy_((t.double() * factor).to(t.dtype))
    elif t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float().mul_(factor))
    else:
        t.mul_(factor)


def exact_divisor(factor: float) -> int | None:
    """``n`` when ``factor`` is ``1/n`` (an average), so integers can be divided exactly:
    49 * (1/49) in float64 is just under 1 and would truncate to 0."""
    divisor = 1.0 / factor
    if divisor == round(divisor) or abs(divisor - round(divisor)) < 1e-9 * abs(divisor):
        return int(round(divisor))
    return None


def _prod(dims: Sequence[int]) -> int:
    return math.prod(dims) if dims else 1


# ---------------------------------------------------------------------------------------------
# small CPU allreduces ride the control round
#
# A CPU allreduce of a few KiB costs more in its second round trip (the Gloo call after the
# negotiation) than in moving its bytes, so its ranks send their input with the request and the
# coordinator reduces and answers with the result: one round trip instead of two. Every rank gets
# the same bytes. The coordinator falls back to the data plane unless every member sent its input.

DEFAULT_INLINE_BYTES = 16 << 10


def inline_payload(req: Request, limit: int) -> bytes | None:
    """``req``'s input bytes if it may be reduced by the coordinator, else None."""
    if req.kind != "allreduce" or req.device.type != "cpu" or limit <= 0:
        return None
    if sum(t.numel() * t.element_size() for t in req.tensors) > limit:
        return None
    return b"".join(_raw_bytes(t) for t in req.tensors)


def _raw_bytes(t: torch.Tensor) -> bytes:
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy().tobytes()  # one torch call: this runs once per small allreduce
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int32: np.int32, torch.int64: np.int64,
                 torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_NUMPY_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                 ReduceOp.PRODUCT: np.multiply}


def _scale_np(a: np.ndarray, factor: float) -> np.ndarray:
    """``scale_``'s rules on a NumPy array (a new array)."""
    if factor == 1.0 or a.size == 0:
        return a
    if a.dtype.kind in "iu":
        d = exact_divisor(factor)
        if d is not None:
            q = np.abs(a) // d  # truncate toward zero, exactly
            return np.where(a < 0, -q, q).astype(a.dtype)
        return (a.astype(np.float64) * factor).astype(a.dtype)
    if a.dtype == np.float16:
        return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return a * a.dtype.type(factor)


def reduce_inline(descriptor: Descriptor, payloads: Sequence[bytes], set_size: int) -> bytes:
    """The allreduce result of ``payloads`` (each member's input bytes, in rank order; ranks that
    joined send none and count as zeros): prescale, reduce, postscale, as the data plane does."""
    op = ReduceOp(descriptor.op)
    post = descriptor.postscale / set_size if op == ReduceOp.AVERAGE else descriptor.postscale
    dtypes = [getattr(torch, name) for name in descriptor.dtypes]
    if all(dt in _NUMPY_DTYPES for dt in dtypes):  # the fast path: one NumPy reduction per tensor
        out, pos = [], 0
        for dt, shape in zip(dtypes, descriptor.shapes):
            n = _prod(shape) * dt.itemsize
            rows = np.frombuffer(b"".join(p[pos : pos + n] for p in payloads), dtype=_NUMPY_DTYPES[dt])
            rows = _scale_np(rows.reshape(len(payloads), -1), descriptor.prescale)
            reduced = _NUMPY_REDUCE[op].reduce(rows, axis=0, dtype=rows.dtype)
            out.append(_scale_np(reduced, post).tobytes())
            pos += n
        return b"".join(out)
    results = None  # bfloat16: through torch
    for data in payloads:
        tensors = _unpack(dtypes, descriptor.shapes, data)
        for t in tensors:
            scale_(t, descriptor.prescale)
        results = tensors if results is None else [_REDUCERS[op](a, b) for a, b in zip(results, tensors)]
    for t in results:
        scale_(t, post)
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in results)


def _unpack(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], data: bytes) -> list[torch.Tensor]:
    out, pos = [], 0
    for dtype, shape in zip(dtypes, shapes):
        n = _prod(shape) * dtype.itemsize
        raw = torch.frombuffer(bytearray(data[pos : pos + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(shape))
        pos += n
    return out


_REDUCERS = {ReduceOp.SUM: torch.add, ReduceOp.AVERAGE: torch.add, ReduceOp.MIN: torch.minimum,
             ReduceOp.MAX: torch.maximum, ReduceOp.PRODUCT: torch.mul}


def write_inline(req: Request, result: bytes) -> list[torch.Tensor]:
    """``req``'s results from the coordinator's bytes: written into its outputs when in place."""
    outs, pos = [], 0
    for i, t in enumerate(req.tensors):
        n = t.numel() * t.element_size()
        target = req.outputs[i] if req.outputs is not None else None
        if t.dtype in _NUMPY_DTYPES:
            value = np.frombuffer(result, dtype=_NUMPY_DTYPES[t.dtype], count=t.numel(), offset=pos)
            if target is None:
                outs.append(torch.from_numpy(value.reshape(t.shape).copy()))
            else:
                np.copyto(target.numpy().reshape(-1), value)
                outs.append(target)
        else:
            raw = torch.frombuffer(bytearray(result[pos : pos + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            value = raw.view(t.dtype).reshape(t.shape)
            if target is not None:
                target.copy_(value)
                value = target
            outs.append(value)
        pos += n
    return outs


# ---------------------------------------------------------------------------------------------
# execution (engine's issuing thread)

Plan = tuple[list[Any], Callable[[], Any]]  # backend works, and the step that produces the result


class Executor:
    """Turns negotiated requests into backend calls for one initialized job.

    ``groups(set_id)`` gives the process set a request runs on (its members, this rank's index in
    it, its Gloo and NCCL backends); ``meta`` is what the coordinator added: the other ranks' first
    dimensions for allgather and the matrix of splits for alltoall, so no extra exchange is needed."""

    def __init__(self, groups: Callable[[int], Any], tracer: Callable[[], Any] = lambda: None) -> None:
        self._groups = groups
        self._tracer = tracer  # the timeline's tracer while one is recording (rank 0), else None
        self._streams: dict[int, Any] = {}

    def __call__(self, req: Request, meta: dict) -> Issued:
        group = self._groups(req.set_id)
        tracer = self._tracer()
        if req.device.type == "cpu":
            works, after = self._plan(req, meta, group, group.gloo(), None)
            if tracer is not None:
                tracer.cpu_op(req.name, req.kind, req.tensors, works)
            return Issued(works, None, after)
        backend = group.nccl()
        comm = self._comm_stream(req.device)
        trace = tracer.gpu_op(req.name, req.kind, comm) if tracer is not None else None
        comm.wait_event(req.ready_event)
        if trace is not None:
            trace.step("QUEUE", comm)
        with torch.cuda.stream(comm):
            works, after = self._plan(req, meta, group, backend, comm.cuda_stream)
            result = after()
            if trace is not None:
                trace.step(f"NCCL_{req.kind.upper()}", comm)
                trace.submit(req.tensors[0].dtype if req.tensors else None,
                             req.tensors[0].shape if len(req.tensors) == 1 else f"[{len(req.tensors)} tensors]")
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

    def _plan(self, req: Request, meta: dict, group, backend, stream: int | None) -> Plan:
        return getattr(self, "_" + req.kind)(req, meta, group, backend, stream)

    # -- collectives -------------------------------------------------------------------------
    @staticmethod
    def _wire(req: Request, group, backend, dtype: torch.dtype) -> tuple[WireOp, float]:
        """The backend reduction and the post-scale that together give ``req.op``."""
        if req.op != ReduceOp.AVERAGE:
            return _WIRE[req.op], req.postscale
        if backend.name == "nccl" and dtype.is_floating_point and req.prescale == 1.0 and req.postscale == 1.0:
            return WireOp.AVG, 1.0
        return WireOp.SUM, req.postscale / group.size

    def _allreduce(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        outs = req.outputs if req.outputs is not None else [torch.empty_like(t) for t in req.tensors]
        if len(req.tensors) == 1:
            src, out = req.tensors[0], outs[0]  # contiguous: backends need no flat view
            if out is not src:
                out.copy_(src)
            scale_(out, req.prescale)
            wire, post = self._wire(req, group, backend, out.dtype)
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
            wire, post = self._wire(req, group, backend, dtype)
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

    def _broadcast(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        src = req.tensors[0]
        root = group.index_of(req.root)
        out = req.outputs[0] if req.outputs is not None else (src.clone() if group.rank == root else torch.empty_like(src))
        work = backend.broadcast(out.view(-1), out.view(-1), root=root, stream=stream)
        return [w for w in (work,) if w is not None], lambda: [out]

    def _allgather(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        for i, t in enumerate(req.tensors):
            rows = meta["rows"][i]
            tail = list(t.shape[1:])
            row_numel = _prod(tail)
            most = max(rows)
            send = t.reshape(-1)
            if min(rows) != most:  # uneven first dimension: pad to the longest, compact afterwards
                send = torch.zeros(most * row_numel, dtype=t.dtype, device=t.device)
                send[: t.numel()].copy_(t.reshape(-1))
            recv = torch.empty(group.size * most * row_numel, dtype=t.dtype, device=t.device)
            w = backend.allgather(send, recv, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows, most, row_numel, tail, t.dim() == 0))

        def after():
            outs = []
            for recv, rows, most, row_numel, tail, scalar in pieces:
                if scalar:
                    outs.append(recv.view(group.size))
                elif min(rows) == most:
                    outs.append(recv.view(group.size * most, *tail))
                else:
                    parts = [recv[r * most * row_numel : (r * most + rows[r]) * row_numel] for r in range(group.size)]
                    outs.append(torch.cat(parts).view(sum(rows), *tail))
            return outs, [p[1] for p in pieces]

        return works, after

    def _alltoall(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        t = req.tensors[0]
        matrix = meta["splits"]
        splits = matrix[group.rank]
        received = [matrix[r][group.rank] for r in range(group.size)]
        tail = list(t.shape[1:])
        row_numel = _prod(tail)
        recv = torch.empty(sum(received) * row_numel, dtype=t.dtype, device=t.device)
        w = backend.alltoall(t.reshape(-1), recv, [s * row_numel for s in splits], [s * row_numel for s in received],
                             stream=stream)
        return [w] if w is not None else [], lambda: (recv.view(sum(received), *tail), received)

    def _reducescatter(self, req: Request, meta: dict, group, backend, stream) -> Plan:
        works, pieces = [], []
        for t in req.tensors:
            rows = reducescatter_rows(t.shape[0], group.size)
            tail = list(t.shape[1:])
            row_numel, most = _prod(tail), rows[0]
            send = torch.zeros(group.size * most * row_numel, dtype=t.dtype, device=t.device)
            flat, pos = t.reshape(-1), 0
            for r, n in enumerate(rows):  # rank r's rows go to slot r, padded to the longest slot
                send[r * most * row_numel : (r * most + n) * row_numel].copy_(flat[pos : pos + n * row_numel])
                pos += n * row_numel
            scale_(send, req.prescale)
            recv = torch.empty(most * row_numel, dtype=t.dtype, device=t.device)
            wire, post = self._wire(req, group, backend, t.dtype)
            w = backend.reducescatter(send, recv, op=wire, stream=stream)
            if w is not None:
                works.append(w)
            pieces.append((recv, rows[group.rank], row_numel, tail, post))

        def after():
            outs = []
            for recv, n, row_numel, tail, post in pieces:
                out = recv[: n * row_numel].view(n, *tail)
                scale_(out, post)
                outs.append(out)
            return outs

        return works, after
