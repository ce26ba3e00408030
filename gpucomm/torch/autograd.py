"""Differentiable collectives with Horovod's gradient conventions."""

from __future__ import annotations


import torch

from .. import runtime
from .compression import Compression
from .mpi_ops import (Average, Sum, _check_root, _submit, allgather_async, allreduce_async, alltoall_async,
                      grouped_allreduce_async, grouped_reducescatter_async, handle_average_backwards_compatibility,
                      reducescatter_async, synchronize)
from ..ops import ReduceOp


def _size() -> int:
    return runtime.current().world.size


def _rank() -> int:
    return runtime.current().world.rank


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, name):
        ctx.args = (op, pre, post)
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post = ctx.args
        out = synchronize(allreduce_async(grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post))
        return out, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, *tensors):
        ctx.args = (op, pre, post)
        return tuple(synchronize(grouped_allreduce_async(tensors, name=name, op=op, prescale_factor=pre,
                                                         postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post = ctx.args
        outs = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=op, prescale_factor=pre,
                                                   postscale_factor=post))
        return (None, None, None, None, *outs)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        outs, rows = synchronize(_submit("allgather", [tensor], name, lambda r: r))
        ctx.rows = rows[0]
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average))
        start = sum(ctx.rows[: _rank()])
        return reduced.narrow(0, start, ctx.rows[_rank()]) if reduced.dim() else reduced, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root = root_rank
        return synchronize(_submit("broadcast", [tensor], name, lambda r: r[0], root=_check_root(root_rank)))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average))
        if _rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        return out, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, pre, post, name):
        ctx.factor = pre * post * (_size() if op == Sum else 1)
        return synchronize(reducescatter_async(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post))

    @staticmethod
    def backward(ctx, grad):
        gathered = synchronize(allgather_async(grad.contiguous()))
        return gathered * ctx.factor, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, *tensors):
        ctx.factor = pre * post * (_size() if op == Sum else 1)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name=name, op=op, prescale_factor=pre,
                                                             postscale_factor=post)))

    @staticmethod
    def backward(ctx, *grads):
        outs = synchronize(_submit("allgather", [g.contiguous() for g in grads], None, lambda r: r[0]))
        return (None, None, None, None, *[o * ctx.factor for o in outs])


# -- public differentiable forms ----------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks into a new tensor (default op: Average). Differentiable."""
    rop = handle_average_backwards_compatibility(op, average)
    compressed, cctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, rop, float(prescale_factor), float(postscale_factor), name)
    return compression.decompress(reduced, cctx)


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, compression=Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce several tensors in one fused operation. Differentiable."""
    rop = handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(rop, float(prescale_factor), float(postscale_factor), name, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ per rank). Differentiable."""
    return _Allgather.apply(tensor, name)


def grouped_allgather(tensors, name: str | None = None) -> list[torch.Tensor]:
    """Allgather several tensors in one request (no autograd for the grouped form)."""
    return synchronize(_submit("allgather", list(tensors), name, lambda r: r[0]))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Root's ``tensor`` as a new tensor on every rank. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None):
    """Send ``splits[i]`` rows to rank i. Returns the tensor, or ``(tensor, received_splits)`` when
    ``splits`` is given (Horovod's convention). Differentiable."""
    out, received = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none, op: int = Average,
                  *, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks, each rank keeping its share of dim 0. Differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, ReduceOp(op), float(prescale_factor), float(postscale_factor), name)
    return compression.decompress(out, cctx)


def grouped_reducescatter(tensors, name: str | None = None, compression=Compression.none, op: int = Average,
                          *, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(ReduceOp(op), float(prescale_factor), float(postscale_factor), name,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
