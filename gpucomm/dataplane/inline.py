"""Small CPU allreduces ride the control round.

A CPU allreduce of a few KiB costs more in its second round trip (the Gloo call after the
negotiation) than in moving its bytes, so its ranks send their input with the request and the
coordinator reduces and answers with the result: one round trip instead of two. Every rank gets
the same bytes. The coordinator falls back to the data plane unless every member sent its input.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from ..reduce_op import ReduceOp
from .requests import Request, exact_divisor, scale_

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


def reduce_inline(descriptor: Any, payloads: Sequence[bytes], set_size: int) -> bytes:
    """The allreduce result of ``payloads`` (each member's input bytes, in rank order; ranks that
    joined send none and count as zeros): prescale, reduce, postscale, as the data plane does."""
    op = ReduceOp(descriptor.op)
    post = descriptor.postscale / set_size if op == ReduceOp.AVERAGE else descriptor.postscale
    dtypes = [getattr(torch, name) for name in descriptor.dtypes]
    if all(dt in _NUMPY_DTYPES for dt in dtypes):  # the fast path: one NumPy reduction per tensor
        out, pos = [], 0
        for dt, shape in zip(dtypes, descriptor.shapes):
            n = math.prod(shape) * dt.itemsize
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
        n = math.prod(shape) * dtype.itemsize
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


__all__ = ["DEFAULT_INLINE_BYTES", "inline_payload", "reduce_inline", "write_inline"]
