"""MPI types and operations for CPU tensors, for gpucomm's MPI backend (``mpi.py``).

Reductions. Integer and float32/64 types reduce with MPI's own types and operations (int8/uint8 as
``MPI_INT8_T``/``MPI_UINT8_T``: sums wrap around modulo 256, as in torch and Gloo). MPI has no
float16 or bfloat16: they travel as 2-byte ``MPI_UINT16_T`` elements and reduce through a
user-defined, commutative ``MPI_Op`` whose function applies torch's own kernel to the two buffers
(``torch.frombuffer`` views, no copy): each pairwise step rounds to the half type, as Gloo and NCCL
do, and the wire carries 2 bytes per element. ``BackendOp.AVG`` is a sum followed by a division of the
result (floating types only). Data movement (allgather, broadcast, alltoall) sends elements of the
dtype's size, so any fixed-size dtype moves, bool and bfloat16 included.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .base import BackendOp


def buffer_of(MPI: Any, t: torch.Tensor) -> Any:
    """The tensor's own memory as an MPI buffer (no copy)."""
    return MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory overlaps (MPI then needs ``MPI_IN_PLACE``)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


HALF_TYPES = (  # MPI has no such types: 2-byte elements reduced by torch (half_op)
    torch.float16, torch.bfloat16)
_half_ops: dict[tuple[torch.dtype, BackendOp], Any] = {}
_types_lock = threading.Lock()
_move_types: dict[int, Any] = {}
_reduce_types: dict[torch.dtype, Any] = {}


def reduce_type(MPI: Any, dtype: torch.dtype) -> Any:
    """The MPI type a reduction of ``dtype`` uses (half types: 2-byte ``MPI_UINT16_T``)."""
    found = _reduce_types.get(dtype)
    if found is not None:
        return found
    table = {torch.uint8: MPI.UINT8_T, torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T,
             torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.float32: MPI.FLOAT,
             torch.float64: MPI.DOUBLE, torch.float16: MPI.UINT16_T, torch.bfloat16: MPI.UINT16_T}
    for name in ("uint16", "uint32", "uint64"):  # torch >= 2.3
        dt = getattr(torch, name, None)
        if dt is not None:
            table[dt] = getattr(MPI, name.upper() + "_T")
    _reduce_types.update(table)
    mpi_type = table.get(dtype)
    if mpi_type is None:
        raise ValueError(f"the MPI backend cannot reduce {dtype}: it reduces uint8, int8, int16, int32, int64, float16, "
                         f"bfloat16, float32 and float64 (the op layer validates this first; reaching here is a bug).")
    return mpi_type


def half_op(MPI: Any, dtype: torch.dtype, op: BackendOp) -> Any:
    """A user-defined MPI reduction for a half type: torch's kernel on the two buffers."""
    key = (dtype, op)
    with _types_lock:
        found = _half_ops.get(key)
        if found is None:
            combine: Callable[[torch.Tensor, torch.Tensor], Any] = {
                BackendOp.SUM: lambda acc, x: acc.add_(x), BackendOp.AVG: lambda acc, x: acc.add_(x),
                BackendOp.PRODUCT: lambda acc, x: acc.mul_(x),
                BackendOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
                BackendOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc)}[op]

            def reduce(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
                if len(inoutbuf) == 0:
                    return
                combine(torch.frombuffer(inoutbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

            found = _half_ops[key] = MPI.Op.Create(reduce, commute=True)
        return found


def reduce_op(MPI: Any, op: BackendOp) -> Any:
    """MPI's own operation for ``op`` (AVG: a sum, divided afterwards)."""
    return {BackendOp.SUM: MPI.SUM, BackendOp.AVG: MPI.SUM, BackendOp.MIN: MPI.MIN, BackendOp.MAX: MPI.MAX,
            BackendOp.PRODUCT: MPI.PROD}[op]


def move_type(MPI: Any, itemsize: int) -> Any:
    """An MPI type of ``itemsize`` bytes to move elements of that size (counts stay in elements)."""
    known = {1: MPI.BYTE, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T}
    if itemsize in known:
        return known[itemsize]
    with _types_lock:
        t = _move_types.get(itemsize)
        if t is None:
            t = _move_types[itemsize] = MPI.BYTE.Create_contiguous(itemsize).Commit()
        return t


def describe_op(kind: str, t: torch.Tensor, extra: str = "") -> str:
    """An operation as error messages name it: kind, element count and dtype."""
    return f"{kind} of {t.numel()} {str(t.dtype).replace('torch.', '')}{extra}"


__all__ = ["HALF_TYPES", "buffer_of", "describe_op", "half_op", "move_type", "overlap", "reduce_op", "reduce_type"]
