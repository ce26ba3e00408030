"""Differentiable collectives with Horovod's gradient conventions."""

from __future__ import annotations

import torch

from .. import runtime
from ..reduce_op import ReduceOp
from ..process_sets import ProcessSet, global_process_set
from .compression import Compression
from .mpi_ops import (Average, Sum, _check_root, _run, _set_id, _submit, allgather_async, allreduce_async,
                      alltoall_async, grouped_allreduce_async, grouped_reducescatter_async,
                      handle_average_backwards_compatibility, reducescatter_async)


def _group(process_set: ProcessSet):
    return runtime.current().group(_set_id(process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, process_set):
        ctx.args = (op, pre, post, process_set)
        return _run(allreduce_async, tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                    process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        out = _run(allreduce_async, grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post,
                   process_set=ps)
        return out, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        return tuple(_run(grouped_allreduce_async, tensors, name=name, op=op, prescale_factor=pre,
                          postscale_factor=post, process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        outs = _run(grouped_allreduce_async, [g.contiguous() for g in grads], op=op, prescale_factor=pre,
                    postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *outs)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        outs, rows = _run(_submit, "allgather", [tensor], name, lambda r: r, process_set=process_set)
        ctx.rows, ctx.process_set = rows[0], process_set
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        reduced = _run(allreduce_async, grad.contiguous(), op=Average, process_set=ps)
        me = _group(ps).rank
        start = sum(ctx.rows[:me])
        return (reduced.narrow(0, start, ctx.rows[me]) if reduced.dim() else reduced), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return _run(_submit, "broadcast", [tensor], name, lambda r: r[0], root=_check_root(root_rank, process_set),
                    process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _run(allreduce_async, grad.contiguous(), op=Average, process_set=ctx.process_set)
        if runtime.current().world.rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _run(alltoall_async, tensor, splits, name, process_set)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        out, _ = _run(alltoall_async, grad.contiguous(), ctx.received, None, ctx.process_set)
        return out, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, process_set):
        ctx.factor = pre * post * (_group(process_set).size if op == Sum else 1)
        ctx.process_set = process_set
        return _run(reducescatter_async, tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                    process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        gathered = _run(allgather_async, grad.contiguous(), process_set=ctx.process_set)
        return gathered * ctx.factor, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.factor = pre * post * (_group(process_set).size if op == Sum else 1)
        ctx.process_set = process_set
        return tuple(_run(grouped_reducescatter_async, tensors, name=name, op=op, prescale_factor=pre,
                          postscale_factor=post, process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        outs = _run(_submit, "allgather", [g.contiguous() for g in grads], None, lambda r: r[0],
                    process_set=ctx.process_set)
        return (None, None, None, None, None, *[o * ctx.factor for o in outs])


# -- public differentiable forms ----------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``process_set`` into a new tensor (default op: Average). Differentiable."""
    rop = handle_average_backwards_compatibility(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, rop, float(prescale_factor), float(postscale_factor), name, process_set)
    return compression.decompress(reduced, cctx)


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, compression=Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors in one fused operation. Differentiable."""
    rop = handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(rop, float(prescale_factor), float(postscale_factor), name, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ per rank). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather several tensors in one request (no autograd for the grouped form)."""
    return _run(_submit, "allgather", list(tensors), name, lambda r: r[0], process_set=process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's ``tensor`` as a new tensor on every rank. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Send ``splits[i]`` rows to rank i. Returns the tensor, or ``(tensor, received_splits)`` when
    ``splits`` is given (Horovod's convention). Differentiable."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks, each rank keeping its share of dim 0. Differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, ReduceOp(op), float(prescale_factor), float(postscale_factor), name,
                               process_set)
    return compression.decompress(out, cctx)


def grouped_reducescatter(tensors, name: str | None = None, compression=Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(ReduceOp(op), float(prescale_factor), float(postscale_factor), name,
                                       process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
