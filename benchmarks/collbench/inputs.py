"""What each rank sends: small integers chosen per operation so every result is exact in every dtype,
and the send/receive buffers that hold them (overlapping, in place, as nccl-tests lays them out)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sizes import REDUCING, Layout

# nccl-tests' type names, in its "-d all" order (uint32/uint64 left out: gpucomm does not carry them).
DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
          "half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' "-o all" order


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


def cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 -> dtype: integers wrap as the wire types do, floats are exact for these magnitudes."""
    return values.to(dtype) if not dtype.is_floating_point else values.double().to(dtype)


def make_input(kind: str, start: int, n: int, rank: int, nranks: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Elements [start, start+n) of rank ``rank``'s input for ``kind``, in ``dtype`` on ``device``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return cast(input_values(kind, idx, rank, nranks, dtype), dtype)


def sentinel(dtype: torch.dtype) -> int:
    """Receive buffers start with this: inputs and results are >= 0 (short of integer overflow at
    very large rank counts), so a result never written is counted."""
    return 255 if dtype == torch.uint8 else -1


def input_kind(coll: str, op: str) -> str:
    """The inputs a collective gets: its reduction op's, or ``none`` for data movement."""
    return op if coll in REDUCING else "none"


@dataclass
class Buffers:
    """One call's send and receive tensors (views of one buffer when in place)."""

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
