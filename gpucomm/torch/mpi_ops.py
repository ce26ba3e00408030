"""Horovod's collective functions on torch tensors: sync, async (integer handles) and in-place forms.

Names follow Horovod so that ``import gpucomm.torch as hvd`` is the only change a script needs.
Autograd lives in ``autograd.py``; these functions are the non-differentiable building blocks.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

import torch

from .. import runtime
from ..ops import (ReduceOp, Request, check_op, check_tensors, equal_splits)

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT)

_handles: dict[int, tuple[Any, Callable[[Any], Any]]] = {}
_handles_lock = threading.Lock()
_counter = itertools.count()


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> ReduceOp:
    """Horovod's rule for the deprecated ``average=`` flag."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    return ReduceOp(op) if op is not None else Average


def _name(kind: str, name: str | None, handle: int) -> str:
    return f"{kind}.{name}" if name else f"{kind}.noname.{handle}"


def _submit(kind: str, tensors: Sequence[torch.Tensor], name: str | None, convert: Callable[[Any], Any], *,
            in_place: bool = False, reducing: bool = False, **fields: Any) -> int:
    """Validate, submit and register a request; returns Horovod's integer handle."""
    rt = runtime.current()
    device = check_tensors(kind, tensors, reducing=reducing)
    if "op" in fields:
        check_op(kind, fields["op"])
    detached = [t.detach() if t.requires_grad else t for t in tensors]  # in-place targets may be leaves
    handle_id = next(_counter)
    req = Request(kind, _name(kind, name, handle_id), detached, outputs=detached if in_place else None,
                  device=device, **fields)
    handle = rt.submit(req)
    with _handles_lock:
        _handles[handle_id] = (handle, convert)
    return handle_id


def poll(handle: int) -> bool:
    """True if the operation behind ``handle`` has finished; never blocks."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"poll: unknown handle {handle!r}; it was never issued or was already synchronized.")
    return entry[0].poll()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its output; raises ``HorovodInternalError`` if it failed."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise ValueError(f"synchronize: unknown handle {handle!r}; it was never issued or was already synchronized.")
    h, convert = entry
    return convert(h.wait())


def _first(outs: list) -> torch.Tensor:
    return outs[0]


def _check_scale(prescale_factor: float, postscale_factor: float) -> dict:
    return {"prescale": float(prescale_factor), "postscale": float(postscale_factor)}


# -- allreduce -------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start an allreduce into a new tensor; returns a handle for ``synchronize``."""
    rop = handle_average_backwards_compatibility(op, average)
    return _submit("allreduce", [tensor], name, _first, reducing=True, op=rop,
                   **_check_scale(prescale_factor, postscale_factor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start an in-place allreduce of ``tensor``."""
    rop = handle_average_backwards_compatibility(op, average)
    return _submit("allreduce", [tensor], name, _first, in_place=True, reducing=True, op=rop,
                   **_check_scale(prescale_factor, postscale_factor))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start one fused allreduce of several tensors into new tensors."""
    rop = handle_average_backwards_compatibility(op, average)
    return _submit("allreduce", list(tensors), name, list, reducing=True, op=rop,
                   **_check_scale(prescale_factor, postscale_factor))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    rop = handle_average_backwards_compatibility(op, average)
    return _submit("allreduce", list(tensors), name, list, in_place=True, reducing=True, op=rop,
                   **_check_scale(prescale_factor, postscale_factor))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor))


# -- allgather -------------------------------------------------------------------------------
def _gathered_first(result) -> torch.Tensor:
    return result[0][0]


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start an allgather along dim 0 (dim 0 may differ per rank)."""
    return _submit("allgather", [tensor], name, _gathered_first)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None) -> int:
    return _submit("allgather", list(tensors), name, lambda result: result[0])


# -- broadcast -------------------------------------------------------------------------------
def _check_root(root_rank: int) -> int:
    size = runtime.current().world.size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"root_rank={root_rank!r} is not a rank of this job (0..{size - 1}).")
    return root_rank


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start a broadcast of root's ``tensor`` into a new tensor on every rank."""
    return _submit("broadcast", [tensor], name, _first, root=_check_root(root_rank))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start an in-place broadcast of root's ``tensor``."""
    return _submit("broadcast", [tensor], name, _first, in_place=True, root=_check_root(root_rank))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name))


# -- alltoall --------------------------------------------------------------------------------
def _normalize_splits(tensor: torch.Tensor, splits) -> list[int] | None:
    if splits is None:
        return None
    size = runtime.current().world.size
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if len(values) != size or any(int(s) != s or s < 0 for s in values):
        raise ValueError(f"alltoall: splits must hold {size} non-negative integers (one per rank), got {values}.")
    rows = tensor.shape[0] if tensor.dim() else 0
    if sum(values) != rows:
        raise ValueError(f"alltoall: splits sum to {sum(values)} but the tensor's dim 0 is {rows}.")
    return [int(s) for s in values]


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension.")
    norm = _normalize_splits(tensor, splits)
    if norm is None:
        equal_splits(tensor.shape[0], runtime.current().world.size, "alltoall")
    return _submit("alltoall", [tensor], name,
                   lambda r: (r[0], torch.tensor(r[1], dtype=torch.int32)), splits=norm)


# -- reducescatter ---------------------------------------------------------------------------
def _check_reducescatter(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension (it splits dim 0).")


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter: reduce across ranks, each keeps its share of dim 0 (Horovod's split)."""
    _check_reducescatter([tensor])
    return _submit("reducescatter", [tensor], name, _first, reducing=True, op=ReduceOp(op),
                   **_check_scale(prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    _check_reducescatter(tensors)
    return _submit("reducescatter", list(tensors), name, list, reducing=True, op=ReduceOp(op),
                   **_check_scale(prescale_factor, postscale_factor))


# -- barrier ---------------------------------------------------------------------------------
def barrier() -> None:
    """Block until every rank has called ``barrier``."""
    rt = runtime.current()
    handle = rt.submit(Request("barrier", "barrier", []))
    handle.wait()
