"""Framework-neutral requests: what a collective is, and the checks and scaling rules every path shares.

A ``Request`` is validated on the caller's thread (so bad input raises there, at once); the
executor (``executor.py``) turns it into backend calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..reduce_op import ReduceOp

# What each kind of collective accepts. Horovod reduces int32/int64/float16/float32/float64; we add
# bfloat16, uint8 and int8 (both backends reduce them). Data movement takes any fixed-size dtype.
REDUCIBLE = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
MOVABLE = REDUCIBLE + (torch.bool, torch.int16)
_REDUCIBLE_SET, _MOVABLE_SET = frozenset(REDUCIBLE), frozenset(MOVABLE)


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
    stream: Any = None  # CUDA: the caller's stream at submission (its results are ready on it)
    send: torch.Tensor | None = None  # prepared kinds: what this rank sends (``executor.prepare``)
    waited_at_once: bool = False  # the submitter waits right away, on the stream it submitted on
    index: int = -1  # CUDA: the device's ordinal (looked up once, at submission)
    per_step: bool = False  # a fixed schedule's launch: completed by its step's one done event
    set_id: int = 0  # the process set it runs on (0: every rank)
    step: tuple[int, int, int] | None = None  # a fixed schedule's launch: (set id, schedule number, launch from 1)
    ranks: tuple[int, ...] | None = None  # add_process_set: the new set's ranks

    def describe(self) -> str:
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self.tensors[:3])
        more = f" (+{len(self.tensors) - 3} more)" if len(self.tensors) > 3 else ""
        return f"{self.kind} '{self.name}' of [{shapes}{more}] on {self.device}"


DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in MOVABLE}  # what ranks tell each other


# ---------------------------------------------------------------------------------------------
# validation (caller's thread)


def check_tensor_arg(kind: str, tensor: object) -> None:
    """A single-tensor collective's argument must be a tensor; say what to pass instead."""
    if not isinstance(tensor, torch.Tensor):
        what = f"{type(tensor).__name__} {tensor!r}" if isinstance(tensor, (int, float, bool, type(None))) \
            else type(tensor).__name__
        hint = (f"for several tensors use hvd.grouped_{kind}(list)" if isinstance(tensor, (list, tuple))
                else f"wrap a number as torch.tensor(x); for Python objects use hvd.{kind}_object"
                if kind in ("allgather", "broadcast") else "wrap a number as torch.tensor(x)")
        raise TypeError(f"hvd.{kind} expects a torch.Tensor, got {what}; {hint}.")


def check_tensor_list(kind: str, tensors: object) -> list:
    """A grouped collective's argument must be a list or tuple of tensors."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hvd.grouped_{kind} expects a list or tuple of torch.Tensor, got "
                        f"{type(tensors).__name__}; for one tensor use hvd.{kind}(tensor).")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hvd.grouped_{kind}: element {i} is a {type(t).__name__}, not a torch.Tensor.")
    return list(tensors)


def check_tensors(kind: str, tensors: Sequence[torch.Tensor], *, reducing: bool) -> torch.device:
    """Validate dtype, layout and device; return the common device."""
    if not tensors:
        raise ValueError(f"{kind} needs at least one tensor")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kind} expects torch tensors, got {type(t).__name__}; wrap numbers as torch.tensor(x).")
    allowed = _REDUCIBLE_SET if reducing else _MOVABLE_SET
    device = tensors[0].device
    for t in tensors:
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


_OPS = frozenset(ReduceOp)


def check_op(kind: str, op: ReduceOp) -> None:
    if op == ReduceOp.ADASUM:  # hvd.allreduce routes Adasum to gpucomm/torch/adasum.py before building a request
        raise NotImplementedError(
            "gpucomm.Communicator.allreduce does not support op=Adasum; use gpucomm.torch's "
            "hvd.allreduce(op=hvd.Adasum)." if kind == "allreduce" else
            f"{kind} does not support op=Adasum (nor does Horovod): Adasum combines whole tensors pairwise; use "
            f"hvd.Average or hvd.Sum.")
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}; {VALID_OPS}.")


VALID_OPS = "use hvd.Average (0), hvd.Sum (1), hvd.Min (3), hvd.Max (4) or hvd.Product (5)"


def reduce_op_of(op: object) -> ReduceOp:
    """``op`` (a ReduceOp or Horovod's integer code) as a ReduceOp; ValueError naming the valid ones."""
    try:
        return ReduceOp(op)
    except (ValueError, TypeError):
        raise ValueError(f"op={op!r} is not a reduction op; {VALID_OPS}, or hvd.Adasum (2) for allreduce.") from None


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


__all__ = ["MOVABLE", "REDUCIBLE", "ReduceOp", "Request", "check_op", "check_tensors", "equal_splits", "exact_divisor",
           "reducescatter_rows", "scale_"]
