"""``BoundCopy``: the pack or unpack of one bucket, repeated every step at the lowest host cost.

A bucket's tensors (gradients of fixed parameters) keep their shapes and dtype from step to step;
only their addresses may change (``zero_grad(set_to_none=True)`` frees them and backward allocates
anew, often elsewhere: seen on an H100 with ResNet-50, a new address set in almost every bucket and
step). So the layout is checked in full, its table built and uploaded, and its launch prepared for
the first set of addresses; a call then makes one C-level pass over the tensors (their
``data_ptr()``), compares it with the bound one and launches. A new address set for the same
element counts, dtype and contiguity (three more C-level passes) is a rebase: only the tensors'
column of the table is recomputed and uploaded through the bucket's pinned ring
(``packing.rebased_layout``), over the table itself while every launch that read it was on the
same stream (the steady state: the same table, launch and flags every step). Address sets bound
to tables of their own (another stream) are kept, the last few, so layouts that alternate there are
not rebuilt either.

The caller's promise: the tensors passed on later calls have the shapes and dtype of the first
call's (a new address set is checked in full again, so only a same-address, different-shape
tensor would slip through, which a parameter's gradient cannot be).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .packing import Layout, new_layout, rebased_layout, stream_context, stream_for
from .rules import tensor_list

__all__ = ["BoundCopy"]

_PTR = torch.Tensor.data_ptr
_KEEP = 4  # address sets kept per bucket


class BoundCopy:
    """``pack`` (``direction="pack"``: tensors -> flat) or ``unpack`` (flat -> tensors) of one bucket,
    times ``scale``, bound to its layout; see the module doc for the contract. ``checked``: a pack
    that also finds the first tensor holding Inf or NaN (``__call__``'s ``check_out``)."""

    __slots__ = ("direction", "scale", "checked", "_key", "_layout", "_layouts")

    def __init__(self, direction: str, scale: float = 1.0, *, checked: bool = False) -> None:
        if direction not in ("pack", "unpack"):
            raise ValueError(f"BoundCopy direction must be 'pack' or 'unpack', got {direction!r}")
        self.direction, self.scale, self.checked = direction, float(scale), checked
        self._key: tuple | None = None
        self._layout: Layout | None = None
        self._layouts: dict[tuple, Layout] = {}

    def __call__(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, stream: Any = None,
                 check_out: torch.Tensor | None = None, check_limit: int = 1 << 24) -> None:
        """Copy between ``tensors`` and ``flat`` on ``stream`` (default: the current stream). A checked
        pack then writes into the 1-element ``check_out``: 0 if every value is finite, else 1 + the
        index of the first tensor holding Inf or NaN (at most ``check_limit``)."""
        if not isinstance(tensors, (list, tuple)):
            tensors = tensor_list(self.direction, tensors)
        try:
            key = (flat.data_ptr(), flat.dtype, *map(_PTR, tensors))
        except (TypeError, AttributeError):
            key = None  # not tensors: the full check names the problem
        layout = self._layout
        if key != self._key or layout is None:
            layout = self._bind(key, tensors, flat, stream)
        if layout.total > flat.numel():
            layout = self._bind(None, tensors, flat, stream)  # a shorter view at the same address: raises
        launch = layout.launch
        given = stream  # None: the current stream, where torch ops go without a stream context (~8 us each)
        if launch is None:
            if check_out is not None:
                with stream_context(given):
                    check_out.zero_()  # nothing to copy: nothing non-finite
            return
        if flat.is_cuda:
            if stream is None:
                stream = torch.cuda.current_stream(flat.device)
            layout.table.use_on(stream, *layout.companions())
        finite = layout.finite
        if finite is None:
            launch(stream)
            return
        finisher = finite.finisher(check_out, check_limit)  # checked first: nothing fails between the two launches
        launch(stream)
        finite.finish(finisher, stream)  # the result into check_out, the flags cleared: one more launch

    def _bind(self, key: tuple | None, tensors: Sequence[torch.Tensor], flat: torch.Tensor, stream: Any) -> Layout:
        layout = self._layouts.get(key) if key is not None else None
        if layout is None:
            current = stream is None  # then the rows' upload needs no stream context
            if flat.is_cuda:
                stream = stream_for(stream, flat.device)
            base = self._layout
            if key is not None and base is not None and tensors:
                layout = rebased_layout(base, self.direction, tensors, flat, stream, current)  # new addresses only
            if layout is None:
                layout = new_layout(self.direction, tensors, flat, self.scale, stream, self.checked)  # checks everything
            if key is None:
                return layout
            if layout is base:  # rewritten in place: the address sets it was bound to are gone
                self._layouts = {k: v for k, v in self._layouts.items() if v is not base}
            if len(self._layouts) >= _KEEP:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        self._key, self._layout = key, layout
        return layout
