"""What every gradient bucket of one layout shares (``BucketSettings``), and the settings that choose
how gradients meet their buckets: whether they live in them (``GPUCOMM_GRADIENT_VIEWS``), whether
``zero_grad`` keeps them there (``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS``), and the dtype a compressed bucket
travels in when the pack kernels can cast to it (``fused_wire``). The bucket kinds are ``bucket_kinds.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..kernels.rules import CASTS
from ..settings import GRADIENT_VIEWS, ZERO_GRAD_KEEPS_VIEWS
from .buffers import FusionBuffers
from .finite import FiniteSlots
from .grad_layout import SparseSeen

__all__ = ["BucketSettings", "VIEWS_ENV", "WireOf", "fused_wire", "keep_views_wanted", "views_wanted"]

VIEWS_ENV = "GPUCOMM_GRADIENT_VIEWS"  # "0": gradients are packed into and unpacked out of the buckets every step

WireOf = Callable[[torch.dtype], "torch.dtype | None"]  # a gradient dtype -> the dtype it travels in (None: compress)


def views_wanted(environ: Any = None) -> bool:
    """Whether float gradients sent uncompressed live in their buckets (default), per ``GPUCOMM_GRADIENT_VIEWS``."""
    return GRADIENT_VIEWS.read(environ, True)


def keep_views_wanted(environ: Any = None) -> bool:
    """Whether ``zero_grad(set_to_none=True)`` keeps bound views, zeroed, per ``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS``
    (default off: measured on CPU, freeing and packing once cost less than zeroing and accumulating in place)."""
    return ZERO_GRAD_KEEPS_VIEWS.read(environ, False)


def fused_wire(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """The dtype a bucket of ``dtype`` gradients travels in when the compressor asks for ``wire``
    (None: a compressor the kernels cannot fuse), or None when the pack kernels cannot cast to it."""
    if wire is None or wire == dtype or not dtype.is_floating_point:
        return dtype if wire is not None else None
    return wire if (dtype, wire) in CASTS else None


@dataclass(eq=False)
class BucketSettings:
    """What every bucket of one layout shares: the factors packed in and unpacked out, how the
    optimizer averages (``average``: over the set's ranks, with Horovod's ``predivide`` factor),
    the compressor and the dtype each gradient dtype travels in with it (``wire_of``), the process
    set, the finite check, the fusion buffers, the layout each gradient travels in, and the
    timeline's tracer for the current step (None: no timeline), and who is told of a gradient that
    came sparse (``sparse_seen``: a hook by arrival order cannot see it)."""

    compression: Any
    prescale: float
    postscale: float
    set_id: int
    check: FiniteSlots | None
    average: bool = False
    predivide: float = 1.0
    wire_of: WireOf = lambda dtype: dtype
    views: bool = True  # float gradients sent uncompressed live in their buckets (``GPUCOMM_GRADIENT_VIEWS``)
    keep_views: bool = False  # zero_grad(set_to_none=True) zeroes bound views too (``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS``)
    buffers: FusionBuffers = field(default_factory=FusionBuffers)
    strides: dict = field(default_factory=dict)  # parameter -> the strides its gradient travels in
    tracer: Any = None
    # told of a gradient a bucket found sparse and sends densified (the front hands it back sparse)
    sparse_seen: SparseSeen | None = None
