"""``pack`` and ``unpack``: argument checks, the table lookup, and one kernel launch.

The hot path (a layout seen before) costs four C-level passes over the tensor list (addresses and
sizes, the cache key; contiguity and dtypes, skipped with ``validate=False``), one dictionary
lookup and one prepared launch (``launch.Launch``). A caller that copies the same bucket every
step should hold a ``BoundCopy`` (``bound.py``) instead: it checks only the addresses. Anything
unusual falls through to ``rules.validate``, which names the problem; device checks, kernel
choice, table building and upload, and compilation happen only when a layout is new. The cache
key holds both dtypes and the scale, so a hit also yields the kernel and its prepared arguments.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
from typing import Any, Sequence

import numpy as np
import torch

from ..counters import COUNTERS
from ..errors import KernelUnavailableError
from . import launch as _launch
from .devicefns import SIMULATOR
from .rules import tensor_list, validate
from .specs import KernelSpec, select_finisher, select_kernel
from .table import CHUNK_ELEMS, RowPlan, Staging, Table, TableCache

__all__ = ["pack", "unpack", "clear_cache", "cache_info", "compile_variant", "Layout", "RowFlags", "new_layout", "rebased_layout",
           "stream_context"]

_CACHE = TableCache()
_PTR, _NUMEL, _CONTIG = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_unavailable: list[str] = []  # cached reason why CUDA kernels cannot run here ("" = they can)


def pack(srcs: Sequence[torch.Tensor], dst: torch.Tensor, *, scale: float = 1.0, stream: Any = None,
         validate: bool = True) -> None:
    """Copy ``srcs`` back to back into the flat ``dst`` (from element 0), times ``scale``, cast to
    ``dst.dtype``: one kernel launch on ``stream`` (default: torch's current stream on ``dst``'s
    device), none when there is nothing to copy.

    The sources share one dtype; they and ``dst`` are contiguous and on one device. See
    ``gpucomm.kernels.rules`` for the exact numerics (float16/bfloat16 scale in float32, casts
    round to nearest even). A new layout is always checked in full; ``validate=False`` skips the
    per-tensor contiguity and dtype checks when the layout (addresses and sizes) was seen before,
    halving the host cost for callers that guarantee them (gradients of checked parameters).
    """
    _run("pack", srcs, dst, scale, stream, validate)


def unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], *, scale: float = 1.0, stream: Any = None,
           validate: bool = True) -> None:
    """Copy consecutive pieces of the flat ``src`` into ``dsts`` (the reverse of ``pack``), times
    ``scale``, cast to the destinations' dtype: one kernel launch, as ``pack``."""
    _run("unpack", dsts, src, scale, stream, validate)


def compile_variant(src: torch.dtype, dst: torch.dtype, scaled: bool, device: torch.device,
                    checked: bool = False) -> None:
    """Compile now the kernel that copies ``src`` elements into ``dst`` ones (times a scale when
    ``scaled``; the checked pack when ``checked``) for ``device``; KernelUnavailableError when the
    kernels cannot run there, ValueError for a conversion no kernel makes. Compiling happens once
    per process and variant."""
    specs = [select_kernel(src, dst, scaled, checked)]
    if checked:  # and the finisher writing a slot of the buffer's dtype
        specs.append(select_finisher(dst))
    _check_runnable("pack", device)
    if device.type == "cuda" and not SIMULATOR and device.index is not None:
        from numba import cuda  # noqa: PLC0415

        # Numba compiles for and loads into the current context: ``device``'s (a context push and pop,
        # no cudaSetDevice on the way out)
        with cuda.gpus[device.index]:
            for spec in specs:
                _launch.compile_kernel(spec, device)
        return
    for spec in specs:
        _launch.compile_kernel(spec, device)


def clear_cache() -> None:
    """Forget every cached table (tests; or to release their small device arrays)."""
    _CACHE.clear()


def cache_info() -> dict[str, int]:
    """Table cache statistics: ``hits``, ``misses``, ``size``."""
    return {"hits": _CACHE.hits, "misses": _CACHE.misses, "size": len(_CACHE)}


def _run(direction: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float, stream: Any,
         check: bool) -> None:
    tensors = tensor_list(direction, tensors)
    if not isinstance(flat, torch.Tensor) or not flat.is_contiguous():
        validate(direction, tensors, flat)  # raises
    if not tensors:
        return
    try:
        ptrs = tuple(map(_PTR, tensors))
    except TypeError:
        validate(direction, tensors, flat)  # names the element that is not a tensor
        raise
    numels = tuple(map(_NUMEL, tensors))
    if check and (not all(map(_CONTIG, tensors)) or len(set(map(_DTYPE, tensors))) != 1):
        validate(direction, tensors, flat)  # raises with the reason
    scale = float(scale)
    key = (direction, tensors[0].dtype, flat.dtype, scale, flat.data_ptr(), ptrs, numels)  # a launch holds its scale
    layout = _CACHE.get(key)
    if layout is None:
        layout = new_layout(direction, tensors, flat, scale, stream)
        _CACHE.put(key, layout)
    if layout.total > flat.numel():
        validate(direction, tensors, flat)  # the same buffer address, now a shorter view: raises
    layout.run(flat.device, stream)


class Layout:
    """A checked layout: its kernel, its element count, and (when there is anything to copy) its
    table and prepared launch. A layout of a checked pack also holds its per-row flags and the
    tensor each row belongs to (``finite``)."""

    __slots__ = ("spec", "total", "table", "launch", "finite", "plan", "scale", "flat_ptr", "flat_dtype", "dtype",
                 "staging")

    def __init__(self, spec: KernelSpec, total: int, table: Table | None, launch: _launch.Launch | None,
                 finite: "RowFlags | None" = None, *, plan: RowPlan | None = None, scale: float = 1.0,
                 flat_ptr: int = 0, flat_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None,
                 staging: Staging | None = None) -> None:
        self.spec, self.total, self.table, self.launch, self.finite = spec, total, table, launch, finite
        # what ``rebased_layout`` reuses: the row plan, the scale, the flat buffer's address and dtype, the
        # tensors' dtype and the bucket's pinned upload ring (made at the first rebase)
        self.plan, self.scale, self.flat_ptr, self.flat_dtype = plan, scale, flat_ptr, flat_dtype
        self.dtype, self.staging = dtype, staging

    def companions(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a launch reads beside the table (a checked layout's flags and row map)."""
        finite = self.finite
        return () if finite is None else (finite.flags, finite.row_tensor)

    def run(self, device: torch.device, stream: Any) -> None:
        """Launch on ``stream`` (None: the current stream of ``device``)."""
        launch = self.launch
        if launch is None:
            return  # nothing to copy
        if device.type == "cuda":
            stream = stream_for(stream, device)
            self.table.use_on(stream, *self.companions())
        if self.finite is not None:
            with stream_context(stream):
                self.finite.flags.zero_()
        launch(stream)


class RowFlags:
    """A checked pack's per-row flags (int32, set to 1 by the kernel when the row's piece holds Inf or
    NaN; zero between packs) and each row's tensor index (int32), both on the layout's device, and the
    finisher launches that turn them into a slot value (one per slot dtype, prepared at first use;
    ``slot_dtype``: the buffer's, the one compiled with the pack)."""

    __slots__ = ("flags", "row_tensor", "count", "slot_dtype", "_finishers")

    def __init__(self, flags: torch.Tensor, row_tensor: torch.Tensor, count: int, slot_dtype: torch.dtype) -> None:
        self.flags, self.row_tensor, self.count, self.slot_dtype = flags, row_tensor, count, slot_dtype
        self._finishers: dict[torch.dtype, _launch.Launch] = {}

    def finisher(self, out: torch.Tensor | None, limit: int) -> _launch.Launch:
        """The finisher launch that will write into ``out`` (None: only clear the flags), its arguments set:
        prepared, and ``out`` checked, before the pack is launched, so that nothing can fail between the
        pack and the finisher (flags left set would report the next, clean pack as non-finite)."""
        if out is not None and (out.numel() != 1 or not out.is_floating_point() or out.device != self.flags.device):
            raise ValueError(f"the finite check's result goes into one floating element on the buffer's device "
                             f"({self.flags.device}); got a {out.dtype} tensor of {out.numel()} element(s) on "
                             f"{out.device}. Pass a 1-element slot of the fusion buffer (or of its dtype).")
        dtype = out.dtype if out is not None else self.slot_dtype
        finisher = self._finishers.get(dtype)
        if finisher is None:
            finisher = self._finishers[dtype] = _launch.Launch.with_args(select_finisher(dtype), 1, self.flags.device, [
                ctypes.c_uint64(self.flags.data_ptr()), ctypes.c_uint64(self.row_tensor.data_ptr()),
                ctypes.c_int64(self.flags.numel()), ctypes.c_uint64(0), ctypes.c_int64(limit)])
        finisher.set_arg(3, out.data_ptr() if out is not None else 0)
        finisher.set_arg(4, limit)
        return finisher

    def finish(self, finisher: _launch.Launch, stream: Any) -> None:
        """Launch ``finisher`` (from ``finisher()``) after the checked pack, on the same ``stream`` (None: the
        current one): 0 into its slot when no row was flagged, else 1 + the index of the first tensor with a
        flagged row (capped), and the flags cleared for the next pack. No host sync, no torch op. Should the
        launch fail, the flags are zeroed by torch before the error goes on."""
        if stream is None and self.flags.is_cuda and not SIMULATOR:
            stream = torch.cuda.current_stream(self.flags.device)
        try:
            finisher(stream)
        except BaseException:
            with stream_context(stream if self.flags.is_cuda else None):
                self.flags.zero_()
            raise


def stream_context(stream: Any):
    """Run the torch ops of a block on ``stream`` (a CUDA stream), or where they are (None, simulator)."""
    if stream is None or SIMULATOR:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def new_layout(direction: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float,
               stream: Any, checked: bool = False) -> Layout:
    """Check a layout in full, build its table and prepare its launch (compiling the kernel if new);
    ``checked``: a pack that also flags the rows holding Inf or NaN (floating dtypes)."""
    if checked and direction != "pack":
        raise ValueError("only a pack checks for Inf and NaN (the gradients going into the fusion buffer)")
    dtype, total = validate(direction, tensors, flat)
    src_dtype, dst_dtype = (dtype, flat.dtype) if direction == "pack" else (flat.dtype, dtype)
    spec = select_kernel(src_dtype, dst_dtype, scale != 1.0, checked)
    if total == 0:
        return Layout(spec, 0, None, None)
    device = flat.device
    _check_runnable(direction, device)
    if device.type == "cuda":
        stream = stream_for(stream, device)
    ptrs, numels = tuple(map(_PTR, tensors)), tuple(map(_NUMEL, tensors))
    plan = RowPlan(np.fromiter(numels, dtype=np.int64, count=len(numels)), CHUNK_ELEMS)
    COUNTERS.kernel_tables_built += 1
    # the flags and row map first: the table's ready event, recorded after them on the same stream, then
    # covers them too for a stream that waits on it (``Table.use_on``)
    finite = _row_flags(numels, len(plan.tensor), device, stream, flat.dtype) if checked else None
    table = _build_table(direction, spec, plan, flat.data_ptr(), flat.element_size(), ptrs, device, stream)
    launch = _launch.Launch(spec, table.address, table.nrows, table.grid, scale, device,
                            flags_address=finite.flags.data_ptr() if finite is not None else 0)
    return Layout(spec, total, table, launch, finite, plan=plan, scale=scale, flat_ptr=flat.data_ptr(),
                  flat_dtype=flat.dtype, dtype=dtype)


def rebased_layout(base: Layout, direction: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor,
                   stream: Any, current: bool = False) -> Layout | None:
    """``base``'s layout for the same tensors at new addresses (the same flat buffer, element counts,
    dtype, contiguity and device, checked here in C-level passes), or None when anything else differs (the
    caller then checks the layout in full). Only the tensors' column of the table is recomputed and
    uploaded through the bucket's pinned ring: no validation, splitting, compilation or pinning. Where
    the table may be written over (``Table.rewritable``: every launch that read it was on ``stream``)
    the new rows go over it and ``base`` itself is returned, now pointing at the new tensors: no new
    table, launch or flags; else a new layout with its own. ``current``: ``stream`` is the current stream
    of ``flat``'s device (the upload then needs no stream context)."""
    plan, table = base.plan, base.table
    if (plan is None or table is None or base.launch is None or flat.data_ptr() != base.flat_ptr
            or flat.dtype is not base.flat_dtype or not flat.is_contiguous()):
        return None
    # C-level passes only: a bucket's dozens of gradients cost no Python call each (tests/kernels/test_sim.py
    # counts the calls of a rebase)
    dtype, device = base.dtype, flat.device
    if (tuple(map(_NUMEL, tensors)) != plan.numels or not all(map(_CONTIG, tensors))
            or set(map(_DTYPE, tensors)) != {dtype} or set(map(_DEVICE, tensors)) != {device}):
        return None
    if device.type == "cuda":
        if base.staging is None:
            base.staging = Staging(table.rows.shape)
    column, itemsize = (0, base.spec.src_itemsize) if direction == "pack" else (1, base.spec.dst_itemsize)
    addrs = np.fromiter(map(_PTR, tensors), dtype=np.int64, count=len(tensors))
    COUNTERS.kernel_tables_rebased += 1
    if table.rewritable(stream):  # the steady state: the same table, launch and flags, new rows uploaded
        plan.repoint(table.rows, column, addrs, itemsize)
        table.rewrite(stream, base.staging, current)
        COUNTERS.kernel_tables_rewritten += 1
        return base
    rows = plan.rebase(table.rows, column, addrs, itemsize)
    finite = base.finite
    if finite is not None:  # its own flags (a launch of the old layout may still be in flight) and row map, both
        # made on ``stream`` before the table: its ready event covers them for a stream that waits on it, and
        # ``use_on`` keeps them alive there (the old row map was uploaded on the old stream, ordered with nothing)
        finite = _row_flags(plan.numels, len(plan.tensor), device, stream, finite.slot_dtype)
    new_table = Table(rows, table.grid, device, stream, staging=base.staging)
    launch = _launch.Launch(base.spec, new_table.address, new_table.nrows, new_table.grid, base.scale, device,
                            flags_address=finite.flags.data_ptr() if finite is not None else 0)
    return Layout(base.spec, base.total, new_table, launch, finite, plan=plan, scale=base.scale,
                  flat_ptr=base.flat_ptr, flat_dtype=base.flat_dtype, dtype=dtype, staging=base.staging)


def _row_flags(numels: tuple, nrows: int, device: torch.device, stream: Any, slot_dtype: torch.dtype) -> RowFlags:
    """The flags and row-to-tensor map of a checked layout (built once per layout, like its table)."""
    pieces = -(-np.asarray(numels, dtype=np.int64) // CHUNK_ELEMS)
    rows = np.repeat(np.arange(len(numels), dtype=np.int32), pieces)
    assert len(rows) == nrows, (len(rows), nrows)
    row_tensor = torch.from_numpy(rows)
    if device.type == "cuda" and not SIMULATOR:
        with torch.cuda.stream(stream):  # uploaded in the launch stream's order, never blocking the host
            row_tensor = row_tensor.pin_memory().to(device, non_blocking=True)
            flags = torch.zeros(nrows, dtype=torch.int32, device=device)
    else:
        flags = torch.zeros(nrows, dtype=torch.int32)
    return RowFlags(flags, row_tensor, len(numels), slot_dtype)


def _build_table(direction: str, spec: KernelSpec, plan: RowPlan, flat_ptr: int, flat_itemsize: int, ptrs: tuple,
                 device: torch.device, stream: Any) -> Table:
    tensor_addrs = np.fromiter(ptrs, dtype=np.int64, count=len(ptrs))
    sizes = np.asarray(plan.numels, dtype=np.int64)
    flat_addrs = flat_ptr + (np.cumsum(sizes) - sizes) * flat_itemsize
    srcs, dsts = (tensor_addrs, flat_addrs) if direction == "pack" else (flat_addrs, tensor_addrs)
    rows = plan.rows(srcs, dsts, spec.src_itemsize, spec.dst_itemsize)
    return Table(rows, _launch.grid_for(len(rows), device), device, stream)


def stream_for(stream: Any, device: torch.device) -> Any:
    if stream is None:
        return torch.cuda.current_stream(device)
    if not hasattr(stream, "cuda_stream"):
        raise TypeError(f"stream must be a torch.cuda.Stream (or None for the current stream), "
                        f"got {type(stream).__name__}")
    if stream.device != device:
        raise ValueError(f"the stream belongs to {stream.device} but the tensors are on {device}; pass a stream of "
                         f"the tensors' device, e.g. torch.cuda.current_stream({device.index}).")
    return stream


def _check_runnable(direction: str, device: torch.device) -> None:
    """Raise unless the kernels can run on ``device`` in this process."""
    if SIMULATOR:
        if device.type != "cpu":
            raise ValueError(f"{direction}: the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs kernels on the "
                             f"host, so it needs CPU tensors; got {device}. Unset NUMBA_ENABLE_CUDASIM (before numba "
                             f"is imported) to run on the GPU.")
        return
    reason = _unavailable_reason()
    if device.type != "cuda":
        if reason:
            raise KernelUnavailableError(
                f"{direction}: the Numba CUDA kernels need a GPU and none can be used here ({reason}); got {device} "
                f"tensors. For CPU tensors use gpucomm.dataplane.bucket_copy.pack_bucket/unpack_bucket (plain torch ops); to test the "
                f"kernels without a GPU, set NUMBA_ENABLE_CUDASIM=1 before numba is imported.")
        raise ValueError(f"{direction}: the kernels pack CUDA tensors, got {device} tensors. For CPU tensors use "
                         f"gpucomm.dataplane.bucket_copy.pack_bucket/unpack_bucket (plain torch ops).")
    if reason:
        raise KernelUnavailableError(
            f"{direction}: torch sees {device} but Numba cannot use the GPU ({reason}). Likely cause: numba-cuda or "
            f"its CUDA bindings do not match the driver. Fix: install 'numba-cuda[cu13]' (or [cu12]) matching the CUDA "
            f"version `nvidia-smi` reports.")


def _unavailable_reason() -> str:
    """Why Numba cannot drive a GPU in this process, or "" if it can (computed once)."""
    if not _unavailable:
        from numba import cuda  # noqa: PLC0415

        reason = ""
        try:
            if not cuda.is_available():
                reason = "numba.cuda.is_available() is False"
                cuda.current_context()  # raises with the driver's own account
        except Exception as e:  # CudaSupportError is an ImportError
            reason = " ".join(str(e).split()).rstrip(" :") or type(e).__name__
        _unavailable.append(reason)
    return _unavailable[0]
