"""nccl-tests' sizes and bandwidths (``*GetCollByteCount`` and ``*GetBw`` in its per-collective files):
which element counts a sweep point means for each collective, and how a time becomes algbw and busbw."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
REDUCING = frozenset({"allreduce", "reducescatter"})


@dataclass(frozen=True)
class Layout:
    """Element counts of one call, as nccl-tests' ``*GetCollByteCount`` defines them."""

    sendcount: int
    recvcount: int
    paramcount: int  # the count column: what the NCCL call takes as ``count``
    send_ip_offset: int  # in-place: the send buffer starts at recv + rank * send_ip_offset
    recv_ip_offset: int  # in-place: the recv buffer starts at recv + rank * recv_ip_offset


def _unknown(coll: str) -> ValueError:
    return ValueError(f"unknown collective {coll!r}; choose from {', '.join(COLLECTIVES)}")


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
    raise _unknown(coll)


def busbw_factor(coll: str, nranks: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if coll == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    if coll in ("allgather", "reducescatter", "alltoall"):
        return (nranks - 1) / nranks
    if coll == "broadcast":
        return 1.0
    raise _unknown(coll)


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
