"""Differentiable collectives with Horovod's gradient conventions.

The ``torch.autograd.Function`` classes carry Horovod's names and ``apply`` signatures
(``HorovodAllreduce.apply(tensor, average, name, op, prescale_factor, postscale_factor, process_set)``
and the like, as in ``horovod.torch.mpi_ops``), so code that calls them directly keeps working.

Without a gradient to track (no input requires grad, or grad mode is off) the collectives skip
``torch.autograd.Function`` and run directly: same result, less work per call.
"""

from __future__ import annotations

import torch

from ..process_sets import ProcessSet, global_process_set
from .compression import Compression, NoneCompressor, resolve as resolve_compression
from .collectives import alltoall_now
from .submission import (Average, Sum, check_root, check_tensor_arg, check_tensor_list, current_job, execute,
                         handle_average_backwards_compatibility, reduce_op_of, reduction, set_id)


def _group(process_set: ProcessSet):
    return current_job().group(set_id(process_set))


def _allreduce_now(tensor, op, pre, post, name, process_set):
    return execute("allreduce", [tensor], name, **reduction(op, None, pre, post, process_set))[0]


def _grouped_allreduce_now(tensors, op, pre, post, name, process_set):
    return execute("allreduce", list(tensors), name, **reduction(op, None, pre, post, process_set))


def _allgather_now(tensors, name, process_set):
    """(outputs, rows per rank for each tensor)"""
    return execute("allgather", list(tensors), name, process_set=process_set)


def _broadcast_now(tensor, root_rank, name, process_set):
    return execute("broadcast", [tensor], name, root=check_root(root_rank, process_set), process_set=process_set)[0]


def _reducescatter_now(tensors, op, pre, post, name, process_set):
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension (it splits dim 0).")
    return execute("reducescatter", list(tensors), name, **reduction(op, None, pre, post, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce; the gradient is the allreduce (same op and factors) of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor=1.0, postscale_factor=1.0,
                process_set=global_process_set):
        op = handle_average_backwards_compatibility(op, average)
        ctx.args = (op, float(prescale_factor), float(postscale_factor), process_set)
        return _allreduce_now(tensor, *ctx.args[:3], name, process_set)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        out = _allreduce_now(grad.contiguous(), op, pre, post, None, ps)
        return out, None, None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Allreduce of several tensors in one request; gradients as ``HorovodAllreduce``'s."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        op = handle_average_backwards_compatibility(op, average)
        ctx.args = (op, float(prescale_factor), float(postscale_factor), process_set)
        return tuple(_grouped_allreduce_now(tensors, *ctx.args[:3], name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        outs = _grouped_allreduce_now([g.contiguous() for g in grads], op, pre, post, None, ps)
        return (None, None, None, None, None, None, *outs)


class HorovodAllgather(torch.autograd.Function):
    """Allgather along dim 0; the gradient is this rank's rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        outs, rows = _allgather_now([tensor], name, process_set)
        ctx.rows, ctx.process_set = rows[0], process_set
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        reduced = _allreduce_now(grad.contiguous(), Average, 1.0, 1.0, None, ps)
        me = _group(ps).rank
        start = sum(ctx.rows[:me])
        return (reduced.narrow(0, start, ctx.rows[me]) if reduced.dim() else reduced), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """Allgather of several tensors in one request; gradients as ``HorovodAllgather``'s."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        outs, rows = _allgather_now(tensors, name, process_set)
        ctx.rows, ctx.process_set = rows, process_set
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = _grouped_allreduce_now([g.contiguous() for g in grads], Average, 1.0, 1.0, None, ps)
        me = _group(ps).rank
        mine = []
        for out, rows in zip(reduced, ctx.rows):
            mine.append(out.narrow(0, sum(rows[:me]), rows[me]) if out.dim() else out)
        return (None, None, *mine)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast from ``root_rank``; the root's gradient is the averaged output gradient, others' zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return _broadcast_now(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_now(grad.contiguous(), Average, 1.0, 1.0, None, ctx.process_set)
        if current_job().world.rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall by ``splits``; returns (output, received splits); the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = alltoall_now(tensor, splits, name, process_set)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        out, _ = alltoall_now(grad.contiguous(), ctx.received, None, ctx.process_set)
        return out, None, None, None


class HorovodReducescatter(torch.autograd.Function):
    """Reduce-scatter along dim 0; the gradient is the allgathered output gradient, scaled as the op was."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
        op, pre, post = reduce_op_of(op), float(prescale_factor), float(postscale_factor)
        ctx.factor = pre * post * (_group(process_set).size if op == Sum else 1)
        ctx.process_set = process_set
        return _reducescatter_now([tensor], op, pre, post, name, process_set)[0]

    @staticmethod
    def backward(ctx, grad):
        gathered = _allgather_now([grad.contiguous()], None, ctx.process_set)[0][0]
        return gathered * ctx.factor, None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Reduce-scatter of several tensors in one request; gradients as ``HorovodReducescatter``'s."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        op, pre, post = reduce_op_of(op), float(prescale_factor), float(postscale_factor)
        ctx.factor = pre * post * (_group(process_set).size if op == Sum else 1)
        ctx.process_set = process_set
        return tuple(_reducescatter_now(tensors, op, pre, post, name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        outs = _allgather_now([g.contiguous() for g in grads], None, ctx.process_set)[0]
        return (None, None, None, None, None, *[o * ctx.factor for o in outs])


# -- public differentiable forms ----------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` into a new tensor (default op: Average). Differentiable."""
    check_tensor_arg("allreduce", tensor)
    rop = handle_average_backwards_compatibility(op, average)
    if compression is Compression.none or compression is NoneCompressor:
        if not (tensor.requires_grad and torch.is_grad_enabled()):
            return _allreduce_now(tensor, rop, prescale_factor, postscale_factor, name, process_set)
        return HorovodAllreduce.apply(tensor, None, name, rop, prescale_factor, postscale_factor, process_set)
    compression = resolve_compression(compression)  # Compression.powersgd without its call: its wire
    compressed, cctx = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, None, name, rop, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, cctx)


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, compression=Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors in one fused operation. Differentiable."""
    tensors = check_tensor_list("allreduce", tensors)
    rop = handle_average_backwards_compatibility(op, average)
    compression = resolve_compression(compression)
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(None, name, rop, prescale_factor, postscale_factor, process_set,
                                         *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ per rank). Differentiable."""
    check_tensor_arg("allgather", tensor)
    if not (tensor.requires_grad and torch.is_grad_enabled()):
        return _allgather_now([tensor], name, process_set)[0][0]
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather several tensors in one request. Differentiable: each gradient is the per-tensor
    ``allgather``'s (the Average of the gathered gradients, this rank's rows)."""
    tensors = check_tensor_list("allgather", tensors)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return _allgather_now(tensors, name, process_set)[0]
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's ``tensor`` as a new tensor on every rank. Differentiable."""
    check_tensor_arg("broadcast", tensor)
    if not (tensor.requires_grad and torch.is_grad_enabled()):
        return _broadcast_now(tensor, root_rank, name, process_set)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Send ``splits[i]`` rows to rank i. Returns the tensor, or ``(tensor, received_splits)`` when
    ``splits`` is given (Horovod's convention). Differentiable."""
    check_tensor_arg("alltoall", tensor)
    out, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks, each rank keeping its share of dim 0. Differentiable."""
    check_tensor_arg("reducescatter", tensor)
    compression = resolve_compression(compression)  # Compression.powersgd without its call: its wire
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter(tensors, name: str | None = None, compression=Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    tensors = check_tensor_list("reducescatter", tensors)
    compression = resolve_compression(compression)
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
