"""Collectives among one rank, computed where the data lies: no backend, no stream, no event.

In a one-rank job every collective's result is the rank's own data, scaled as the request says:
an in-place op changes nothing but the scaling, an out-of-place one is a copy. So it runs on the
caller's thread as plain tensor ops (on a GPU they queue on the caller's current stream, in
order with its other work), with no NCCL communicator, no communication stream and no event:
what the raw NCCL call does in microseconds is here a copy, or nothing. The results have the
shapes the multi-rank data plane returns (``executor.py``), and the scaling follows its rules
(``requests.scale_``: the prescale before the reduction, the postscale after, integers
truncated), so a script sees the same values at every size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..counters import COUNTERS
from .requests import Request, scale_

__all__ = ["KINDS", "local_result"]


def local_result(req: Request) -> Any:
    """What ``req`` returns in a one-rank job (its outputs written when in place)."""
    COUNTERS.local_ops += 1
    return _KINDS[req.kind](req)


def _scaled(t: torch.Tensor, out: torch.Tensor | None, req: Request) -> torch.Tensor:
    """``t`` reduced over one rank into ``out`` (None: a new tensor): prescale, then postscale
    (an average over one rank divides by 1)."""
    if out is None:
        out = t.clone()
    elif out is not t:
        out.copy_(t)
    if req.prescale != 1.0:
        scale_(out, req.prescale)
    if req.postscale != 1.0:
        scale_(out, req.postscale)  # ReduceOp.AVERAGE: / 1
    return out


def _allreduce(req: Request) -> list[torch.Tensor]:
    outs = req.outputs
    if outs is None:
        return [_scaled(t, None, req) for t in req.tensors]
    return [_scaled(t, out, req) for t, out in zip(req.tensors, outs)]


def _broadcast(req: Request) -> list[torch.Tensor]:
    if req.outputs is not None:
        return list(req.outputs)  # the root's tensor is this rank's own
    return [t.clone() for t in req.tensors]


def _allgather(req: Request) -> tuple[list[torch.Tensor], list[list[int]]]:
    outs, rows = [], []
    for t in req.tensors:
        if t.dim() == 0:
            outs.append(t.reshape(1).clone())
            rows.append([1])
        else:
            outs.append(t.clone())
            rows.append([t.shape[0]])
    return outs, rows


def _alltoall(req: Request) -> tuple[torch.Tensor, list[int]]:
    t = req.tensors[0]
    return t.clone(), [t.shape[0]]


def _reducescatter(req: Request) -> list[torch.Tensor]:
    return [_scaled(t, None, req) for t in req.tensors]  # one rank: every row is its own


_KINDS: dict[str, Callable[[Request], Any]] = {
    "allreduce": _allreduce, "broadcast": _broadcast, "allgather": _allgather, "alltoall": _alltoall,
    "reducescatter": _reducescatter,
}

KINDS = frozenset(_KINDS)  # every reduction op of one value is that value: only the scaling changes it
