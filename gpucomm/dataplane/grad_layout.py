"""A gradient's layout on its way to the wire and back: which tensor a parameter's gradient is sent
from and written to, and the memory order it travels in.

A gradient travels in its parameter's memory order: a ``channels_last`` gradient (or any gradient
whose elements fill one dense block) is packed, unpacked or viewed in a fusion buffer through a
flat view of its memory, with no ``.contiguous()`` copy and no temporary, and every rank uses the
same order because parameters' strides are verified alike across ranks with their shapes.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch

__all__ = ["SparseSeen", "densified", "gradient_targets", "gradient_to_send", "gradients_as_they_are", "layout_of", "send_view",
           "significant_strides", "slot_view", "view_in_order"]

# Told of a parameter whose gradient a bucket found sparse (and sends densified): (parameter, gradient).
SparseSeen = Callable[[torch.Tensor, torch.Tensor], None]

_GRAD, _TRAINS = operator.attrgetter("grad"), operator.attrgetter("requires_grad")


def densified(p: torch.Tensor, g: torch.Tensor, sparse_seen: SparseSeen | None) -> torch.Tensor:
    """``p``'s sparse gradient ``g`` as the bucket sends it (dense); ``sparse_seen`` is told of it."""
    if sparse_seen is not None:
        sparse_seen(p, g)
    return g.to_dense()
_CONTIG = torch.Tensor.is_contiguous


def gradient_targets(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Where each parameter's averaged gradient goes: ``p.grad`` (zeros in ``p``'s layout when it
    has none, dense when it was sparse), None for a parameter frozen since the layout was agreed
    (its gradient is left alone)."""
    targets: list[torch.Tensor | None] = []
    for p in params:
        if not p.requires_grad:
            targets.append(None)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # the parameter's layout: unpacked into in place
        elif p.grad.is_sparse:
            p.grad = p.grad.to_dense()
        targets.append(p.grad)
    return targets


def gradients_as_they_are(params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The gradients of ``params`` themselves, when every parameter trains and has a dense, contiguous
    gradient: what a pack of contiguous parameters (whose travel order is their own) reads, with no view
    made per gradient (C-level passes only: a step's pack on ResNet-50 otherwise makes 322 Python calls
    for its 161 views). None otherwise: then ``send_view`` each."""
    if not all(map(_TRAINS, params)):
        return None
    grads = list(map(_GRAD, params))
    try:
        if all(map(_CONTIG, grads)):
            return grads
    except (TypeError, RuntimeError):  # a parameter without a gradient (None), or a sparse one
        pass
    return None


def send_view(p: torch.Tensor, strides: tuple[int, ...], sparse_seen: SparseSeen | None = None) -> torch.Tensor:
    """``p``'s gradient as a flat tensor in the memory order ``strides`` (see the module doc): a
    view of the gradient itself when it has that layout, one copy otherwise; zeros when it has none.
    A sparse gradient is sent densified, and ``sparse_seen`` is told of it."""
    g = p.grad
    if g is None or not p.requires_grad:
        return torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
    if g.is_sparse:
        g = densified(p, g, sparse_seen)
    view = view_in_order(g, p, strides)
    if view is not None:
        return view
    laid_out = torch.empty_strided(p.shape, strides, dtype=g.dtype, device=g.device)
    laid_out.copy_(g)
    return laid_out.as_strided((p.numel(),), (1,))


def view_in_order(t: torch.Tensor | None, p: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor | None:
    """A flat view of ``t``'s memory when it is laid out in ``p``'s travel order ``strides`` (one
    dense block; the strides of size-1 dimensions do not matter), else None."""
    if t is None or t.shape != p.shape:
        return None
    if t.is_contiguous() and p.is_contiguous():
        return t.view(-1)
    if significant_strides(t.stride(), t.shape) != significant_strides(strides, p.shape):
        return None
    return t.as_strided((t.numel(),), (1,))


def layout_of(p: torch.Tensor) -> tuple[int, ...]:
    """The strides a gradient of ``p`` travels in: ``p``'s own when its elements fill one dense
    block with no overlap (contiguous, channels_last, any permutation of dims; a gradient then
    has them too, by autograd's layout contract), else contiguous strides."""
    if p.is_contiguous():
        return p.stride()
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride()) if sz != 1):
        if stride != expected:
            return torch.empty(p.shape, device="meta").stride()
        expected *= size
    return p.stride()


def significant_strides(strides: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``strides`` with those of size-1 dimensions as 0: two tensors of one shape whose significant
    strides agree lay their elements out in the same order."""
    return tuple(st if sz != 1 else 0 for st, sz in zip(strides, shape))


def gradient_to_send(p: torch.Tensor, sparse_seen: SparseSeen | None = None) -> torch.Tensor:
    """``p``'s gradient as the bucket sends it: zeros when it has none or is frozen (Horovod's rule);
    densified when it is sparse (``sparse_seen`` is told)."""
    g = p.grad
    if g is None or not p.requires_grad:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)
    if g.is_sparse:
        g = densified(p, g, sparse_seen)
    return g if g.is_contiguous() else g.contiguous()


def slot_view(piece: torch.Tensor, p: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``p``'s slot of a fusion buffer (``piece``: its ``p.numel()`` consecutive elements) as a tensor
    of ``p``'s shape laid out in ``strides`` (``layout_of(p)``: one dense block): what ``p.grad``
    becomes when gradients live in the buckets, so the optimizer reads it in ``p``'s own order."""
    return piece.as_strided(p.shape, strides)
