"""Small CPU collectives ride the control round.

A CPU allreduce, broadcast or allgather of a few KiB costs more in its second round trip (the
Gloo or MPI call after the negotiation) than in moving its bytes, so its ranks send their input
with the request and the coordinator answers with the result: one round trip instead of two.
Allreduce inputs are reduced (``reduce_inline``); a broadcast's root sends its tensor and every
other rank an empty payload, an allgather's ranks their own rows, and the result is the members'
payloads joined in rank order (``combine_inline``). Every rank gets the same bytes. The
coordinator falls back to the data plane unless every member sent its payload (a rank whose
``GPUCOMM_INLINE_BYTES`` is lower sends none), or when an allgather's result would exceed
``GATHER_LIMIT``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from ..reduce_op import ReduceOp
from .requests import Request, exact_divisor, scale_

DEFAULT_INLINE_BYTES = 16 << 10
GATHER_LIMIT = 256 << 10  # an allgather whose result is larger runs on the data plane (the answer goes to every rank)
MOVED = ("broadcast", "allgather")  # the data-movement kinds that may ride the control round


def inline_payload(req: Request, limit: int) -> bytes | None:
    """``req``'s input bytes if it is an allreduce the coordinator may reduce, else None."""
    return payload_of(req, limit, -1) if req.kind == "allreduce" else None


def moved_payload(req: Request, limit: int, rank: int) -> bytes | None:
    """What ``rank`` sends with a small CPU broadcast or allgather (else None): the root's tensor
    and nothing from the other ranks of a broadcast, each rank's rows of an allgather."""
    return payload_of(req, limit, rank) if req.kind in MOVED else None


def payload_of(req: Request, limit: int, rank: int) -> bytes | None:
    """The bytes ``rank`` sends with ``req`` so that the coordinator can complete it (None: the
    data plane runs it): an allreduce's or allgather's input, a broadcast root's tensor, nothing
    (``b""``) from a broadcast's other ranks."""
    kind = req.kind
    if (kind != "allreduce" and kind not in MOVED) or req.device.type != "cpu" or limit <= 0:
        return None
    tensors = req.tensors
    if len(tensors) == 1:  # the common case, without the generators
        t = tensors[0]
        if t.numel() * t.element_size() > limit:
            return None
        return b"" if kind == "broadcast" and rank != req.root else _raw_bytes(t)
    if sum(t.numel() * t.element_size() for t in tensors) > limit:
        return None
    return b"" if kind == "broadcast" and rank != req.root else b"".join(_raw_bytes(t) for t in tensors)


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


def reduce_inline(descriptor: Any, payloads: Sequence[bytes], set_size: int) -> bytes:
    """The allreduce result of ``payloads`` (each member's input bytes, in rank order; ranks that
    joined send none and count as zeros): prescale, reduce, postscale, as the data plane does."""
    plan = _plans.get((descriptor, set_size))
    if plan is None:
        plan = _reduce_plan(descriptor, set_size)
    ufunc, pre, post, parts = plan
    if parts is not None:  # the fast path: one NumPy reduction per tensor
        if len(parts) == 1:  # one tensor: the payloads are its rows, back to back
            rows = np.frombuffer(b"".join(payloads), dtype=parts[0][0]).reshape(len(payloads), -1)
            if pre != 1.0:
                rows = _scale_np(rows, pre)
            reduced = ufunc.reduce(rows, axis=0, dtype=rows.dtype)
            return (_scale_np(reduced, post) if post != 1.0 else reduced).tobytes()
        out, pos = [], 0
        for np_dtype, n in parts:
            rows = np.frombuffer(b"".join(p[pos : pos + n] for p in payloads), dtype=np_dtype)
            rows = _scale_np(rows.reshape(len(payloads), -1), pre)
            reduced = ufunc.reduce(rows, axis=0, dtype=rows.dtype)
            out.append(_scale_np(reduced, post).tobytes())
            pos += n
        return b"".join(out)
    op = ReduceOp(descriptor.op)
    dtypes = [getattr(torch, name) for name in descriptor.dtypes]
    results = None  # bfloat16: through torch
    for data in payloads:
        tensors = _unpack(dtypes, descriptor.shapes, data)
        for t in tensors:
            scale_(t, descriptor.prescale)
        results = tensors if results is None else [_REDUCERS[op](a, b) for a, b in zip(results, tensors)]
    for t in results:
        scale_(t, post)
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in results)


_plans: dict[tuple[Any, int], tuple[Any, float, float, list[tuple[Any, int]] | None]] = {}
_PLANS_KEPT = 4096  # descriptors seen; beyond that the table starts again (names are usually few)


def _reduce_plan(descriptor: Any, set_size: int) -> tuple[Any, float, float, list[tuple[Any, int]] | None]:
    """How to reduce ``descriptor``'s payloads, worked out once per descriptor and set size: the
    NumPy reduction, the pre- and post-scale, and each tensor's NumPy dtype and byte count (None
    when a dtype has no NumPy twin, bfloat16: reduced through torch)."""
    op = ReduceOp(descriptor.op)
    post = descriptor.postscale / set_size if op == ReduceOp.AVERAGE else descriptor.postscale
    dtypes = [getattr(torch, name) for name in descriptor.dtypes]
    parts = None
    if all(dt in _NUMPY_DTYPES for dt in dtypes):
        parts = [(np.dtype(_NUMPY_DTYPES[dt]), math.prod(shape) * dt.itemsize)
                 for dt, shape in zip(dtypes, descriptor.shapes)]
    plan = (_NUMPY_REDUCE[op], float(descriptor.prescale), float(post), parts)
    if len(_plans) >= _PLANS_KEPT:
        _plans.clear()
    _plans[(descriptor, set_size)] = plan
    return plan


def combine_inline(descriptor: Any, payloads: Sequence[bytes], set_size: int) -> bytes | None:
    """The coordinator's answer to a collective every member sent its payload for: an allreduce's
    reduction, a broadcast's or allgather's payloads joined in rank order (None: too large an
    allgather, run on the data plane instead)."""
    if descriptor.kind == "allreduce":
        return reduce_inline(descriptor, payloads, set_size)
    if descriptor.kind == "allgather" and sum(len(p) for p in payloads) > GATHER_LIMIT:
        return None
    return b"".join(payloads)


def _unpack(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], data: bytes) -> list[torch.Tensor]:
    out, pos = [], 0
    for dtype, shape in zip(dtypes, shapes):
        n = math.prod(shape) * dtype.itemsize
        raw = torch.frombuffer(bytearray(data[pos : pos + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(shape))
        pos += n
    return out


_REDUCERS = {ReduceOp.SUM: torch.add, ReduceOp.AVERAGE: torch.add, ReduceOp.MIN: torch.minimum,
             ReduceOp.MAX: torch.maximum, ReduceOp.PRODUCT: torch.mul}


def inline_result(req: Request, result: bytes, meta: dict) -> Any:
    """What ``req`` returns, from the coordinator's answer (its outputs written when in place);
    ``meta`` is the coordinator's (an allgather's rows per rank). The same shapes the data plane
    returns."""
    if req.kind == "allreduce":
        return write_inline(req, result)
    if req.kind == "broadcast":
        return write_inline(req, result)  # the root's tensor, of this rank's shape
    # the answer is each rank's payload in turn, and a payload is that rank's tensors in turn
    every_rows = meta["rows"]
    row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in req.tensors]  # a 0-d tensor: one row
    outs = [torch.empty((len(rows),) if t.dim() == 0 else (sum(rows), *t.shape[1:]), dtype=t.dtype)
            for t, rows in zip(req.tensors, every_rows)]
    flat = [out.view(-1).view(torch.uint8).numpy() for out in outs]
    written = [0] * len(outs)
    pos = 0
    for q in range(len(every_rows[0]) if every_rows else 0):
        for i, rows in enumerate(every_rows):
            n = rows[q] * row_bytes[i]
            if n:
                flat[i][written[i] : written[i] + n] = np.frombuffer(result, dtype=np.uint8, count=n, offset=pos)
            written[i] += n
            pos += n
    return outs, list(meta["rows"])


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


__all__ = ["DEFAULT_INLINE_BYTES", "GATHER_LIMIT", "MOVED", "combine_inline", "inline_payload", "inline_result",
           "moved_payload", "payload_of", "reduce_inline", "write_inline"]
