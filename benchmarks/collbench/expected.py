"""What every rank's receive buffer must hold after a call, computed from the inputs of every rank, and
the #wrong count against it (exact, except ``avg`` of floats, which may round)."""

from __future__ import annotations

import torch

from .inputs import cast, input_values, make_input
from .sizes import Layout

_COMBINE = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}


def reduce_expected(op: str, start: int, n: int, nranks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Elements [start, start+n) of the reduction of every rank's input."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    acc = input_values(op, idx, 0, nranks, dtype)
    for r in range(1, nranks):
        acc = _COMBINE[op](acc, input_values(op, idx, r, nranks, dtype))
    if op == "avg":
        acc = acc // nranks  # exact: the inputs were built so the sum is a multiple of nranks
    return cast(acc, dtype)


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
