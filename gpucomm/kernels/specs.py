"""The pack/unpack kernel: one body, specialised per (source type, destination type, conversion).

Every call of ``pack``/``unpack`` is one launch of one of these kernels over a *chunk table*:
a device int64 array of rows ``(src address, dst address, element count)``. Pack and unpack are
the same kernel with the roles of the flat buffer and the tensors swapped in the table.

Load balancing (why a chunk table, not a per-block binary search): the host splits every tensor
into pieces of at most ``CHUNK_ELEMS`` (1024) elements when the table is built (once per layout,
see ``table.py``), and each *warp* copies one piece. A 64 MiB tensor becomes 16k equal,
independent rows spread over every SM, while a tiny tensor costs one short row for one warp (not
a whole idle block), so one huge tensor beside a thousand tiny ones balances with no search in
the kernel: a warp's first loads are its row (three independent loads), then straight coalesced
copying. A binary search over an offsets table would keep the table at K+1 entries but puts a
chain of dependent global loads in front of every tile and makes tiles straddle tensor
boundaries; the host-side split costs some microseconds of NumPy and 24 bytes per piece, paid
only when a layout changes.

Bandwidth: the grid has one warp per row (eight per block; rows beyond ~0.5M are grid-strided),
so the hardware scheduler keeps every SM full and balances the tail, with no occupancy query.
Lane ``l`` of a warp touches elements ``l, l+32, ...`` of its piece with eight loads in flight
before the eight stores (written out: the compiler may not move loads past stores through
unrelated pointers). Every warp instruction reads or writes one contiguous 32-element run,
whatever the alignment of the tensor, and a 25 MiB float32 bucket keeps ~6k warps x 1 KiB in
flight, above the bandwidth-latency product of an H100/H200. The kernel parameters are three
scalars (table address, row count, scale): the parameter block does not grow with the tensor
count, and the launch marshals no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from numba import cuda, int32

from . import devicefns as d
from .rules import FLOAT_DTYPES, checked_conversion, conversion, dtype_name

__all__ = ["KernelSpec", "KERNELS", "FINISHERS", "select_kernel", "select_finisher"]

_LANE_BITS = 5
_LANES = 1 << _LANE_BITS  # elements one warp instruction covers
_NONE_FLAGGED = 0x7FFFFFFF  # the finisher's "no row flagged" (above any 1 + tensor index)


def _make_kernel(src_view: Callable, dst_view: Callable, convert: Callable) -> Callable:
    """The Python body of one kernel variant (compiled with ``cuda.jit``/``compile_ptx``)."""

    def pack_kernel(table, nrows, scale):
        rows = d.view_i64(table, 3 * nrows)
        lane = cuda.threadIdx.x & (_LANES - 1)
        warps = cuda.blockDim.x >> _LANE_BITS
        row = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> _LANE_BITS)
        stride = cuda.gridDim.x * warps
        while row < nrows:
            n = rows[3 * row + 2]
            src = src_view(d.U64(rows[3 * row]), n)
            dst = dst_view(d.U64(rows[3 * row + 1]), n)
            i = lane
            while i + 7 * _LANES < n:
                a0 = src[i]
                a1 = src[i + _LANES]
                a2 = src[i + 2 * _LANES]
                a3 = src[i + 3 * _LANES]
                a4 = src[i + 4 * _LANES]
                a5 = src[i + 5 * _LANES]
                a6 = src[i + 6 * _LANES]
                a7 = src[i + 7 * _LANES]
                dst[i] = convert(a0, scale)
                dst[i + _LANES] = convert(a1, scale)
                dst[i + 2 * _LANES] = convert(a2, scale)
                dst[i + 3 * _LANES] = convert(a3, scale)
                dst[i + 4 * _LANES] = convert(a4, scale)
                dst[i + 5 * _LANES] = convert(a5, scale)
                dst[i + 6 * _LANES] = convert(a6, scale)
                dst[i + 7 * _LANES] = convert(a7, scale)
                i += 8 * _LANES
            while i < n:
                dst[i] = convert(src[i], scale)
                i += _LANES
            row += stride

    return pack_kernel


def _make_checked_kernel(src_view: Callable, dst_view: Callable, convert: Callable, bad: Callable) -> Callable:
    """The body of a *checked* pack variant: the same copy as ``_make_kernel``'s, and ``flags[row]``
    set to 1 when the row's piece holds an Inf or NaN after conversion (``bad`` tests one destination
    element from its bits). ``flags`` (int32, one per row) is zeroed before the launch; every lane
    that saw one writes the same 1, so no atomic is needed. A piece is read once: the check costs
    one AND and one compare per element, in registers."""

    def pack_checked_kernel(table, nrows, scale, flags_addr):
        rows = d.view_i64(table, 3 * nrows)
        flags = d.view_i32(flags_addr, nrows)
        lane = cuda.threadIdx.x & (_LANES - 1)
        warps = cuda.blockDim.x >> _LANE_BITS
        row = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> _LANE_BITS)
        stride = cuda.gridDim.x * warps
        while row < nrows:
            n = rows[3 * row + 2]
            src = src_view(d.U64(rows[3 * row]), n)
            dst = dst_view(d.U64(rows[3 * row + 1]), n)
            seen = False
            i = lane
            while i + 3 * _LANES < n:
                a0 = src[i]
                a1 = src[i + _LANES]
                a2 = src[i + 2 * _LANES]
                a3 = src[i + 3 * _LANES]
                y0 = convert(a0, scale)
                y1 = convert(a1, scale)
                y2 = convert(a2, scale)
                y3 = convert(a3, scale)
                dst[i] = y0
                dst[i + _LANES] = y1
                dst[i + 2 * _LANES] = y2
                dst[i + 3 * _LANES] = y3
                if bad(y0) or bad(y1) or bad(y2) or bad(y3):
                    seen = True
                i += 4 * _LANES
            while i < n:
                y = convert(src[i], scale)
                dst[i] = y
                if bad(y):
                    seen = True
                i += _LANES
            if seen:
                flags[row] = 1
            row += stride

    return pack_checked_kernel


def _make_finish_kernel(out_view: Callable, encode: Callable) -> Callable:
    """The body of a *finisher*: after a checked pack on the same stream, one block reads the pack's
    per-row flags, clears them for the next pack, and writes into the 1-element slot at ``out_addr`` 0
    when no row was flagged, else ``min(1 + the first flagged row's tensor, limit)``, encoded in the
    slot's dtype (``out_addr`` 0: only the clearing). One launch in place of the five small torch ops
    (and the flags' zeroing) that found the first flagged tensor before: the finite check's result costs
    the host one kernel launch per bucket. Threads scan the rows with a block-wide stride; the smallest
    tensor index meets in shared memory (an atomic min: only flagged rows reach it)."""

    def finish_checked_kernel(flags_addr, tensors_addr, nrows, out_addr, limit):
        flags = d.view_i32(flags_addr, nrows)
        tensor_of = d.view_i32(tensors_addr, nrows)
        first = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        if tid == 0:
            first[0] = _NONE_FLAGGED
        cuda.syncthreads()
        mine = _NONE_FLAGGED
        i = tid
        while i < nrows:
            if flags[i] != 0:
                flags[i] = 0
                t = tensor_of[i] + 1
                if t < mine:
                    mine = t
            i += cuda.blockDim.x
        if mine != _NONE_FLAGGED:
            cuda.atomic.min(first, 0, np.int32(mine))
        cuda.syncthreads()
        if tid == 0 and out_addr != 0:
            v = first[0]
            value = 0
            if v != _NONE_FLAGGED:
                value = min(v, limit)
            out = out_view(out_addr, 1)
            out[0] = encode(value)

    return finish_checked_kernel


# -- conversions: (element, scale) -> destination element ---------------------------------------
@d.device_function
def _copy(x, s):
    return x


@d.device_function
def _scale(x, s):  # float32 * float32, or float64 * float64
    return d.mul(x, s)


@d.device_function
def _scale_f16(x, s):
    return d.to_f16(d.mul(d.to_f32(x), s))


@d.device_function
def _scale_bf16(h, s):
    return d.bf16_from_f32(d.mul(d.f32_from_bf16(h), s))


@d.device_function
def _f32_to_f16(x, s):
    return d.to_f16(x)


@d.device_function
def _f32_to_f16_scaled(x, s):
    return d.to_f16(d.mul(x, s))


@d.device_function
def _f32_to_bf16(x, s):
    return d.bf16_from_f32(x)


@d.device_function
def _f32_to_bf16_scaled(x, s):
    return d.bf16_from_f32(d.mul(x, s))


@d.device_function
def _f16_to_f32(x, s):
    return d.to_f32(x)


@d.device_function
def _f16_to_f32_scaled(x, s):
    return d.mul(d.to_f32(x), s)


@d.device_function
def _bf16_to_f32(h, s):
    return d.f32_from_bf16(h)


@d.device_function
def _bf16_to_f32_scaled(h, s):
    return d.mul(d.f32_from_bf16(h), s)


# -- the finishers' encodings: slot value (a small integer) -> the slot's element -------------------
@d.device_function
def _int_f32(v):
    return d.to_f32(v)


@d.device_function
def _int_f16(v):
    return d.to_f16(d.to_f32(v))


@d.device_function
def _int_bf16(v):  # exact: slot values stay within bfloat16's exact integers (256, the slot's limit)
    return d.bf16_from_f32(d.to_f32(v))


@d.device_function
def _int_f64(v):
    return v * 1.0


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant: its Python body, its single signature, and its element sizes."""

    name: str
    pyfunc: Callable
    scale_type: str  # "float32" or "float64": the third parameter
    src_itemsize: int
    dst_itemsize: int
    checked: bool = False  # a fourth parameter: the address of one int32 flag per row (Inf/NaN seen)
    params: tuple[str, ...] = ()  # a kernel of another signature (a finisher): its parameter types, by name

    @property
    def argtypes(self) -> tuple:
        from numba.cuda import types  # noqa: PLC0415 - numba.cuda.types differs in the simulator

        if self.params:
            return tuple(getattr(types, name) for name in self.params)
        scalars = (types.uint64, types.int64, getattr(types, self.scale_type))
        return scalars + (types.uint64,) if self.checked else scalars

    @property
    def uses_float64(self) -> bool:
        return self.scale_type == "float64"


def _spec(name, src_view, dst_view, convert, itemsizes, scale_type="float32") -> KernelSpec:
    return KernelSpec(name, _make_kernel(src_view, dst_view, convert), scale_type, *itemsizes)


def _checked(name, src_view, dst_view, convert, bad, itemsizes, scale_type="float32") -> KernelSpec:
    return KernelSpec(name, _make_checked_kernel(src_view, dst_view, convert, bad), scale_type, *itemsizes,
                      checked=True)


KERNELS: dict[str, KernelSpec] = {s.name: s for s in (
    # bit copies (any dtype, scale 1): the scale parameter is unused
    _spec("copy8", d.view_u8, d.view_u8, _copy, (1, 1)),
    _spec("copy16", d.view_u16, d.view_u16, _copy, (2, 2)),
    _spec("copy32", d.view_u32, d.view_u32, _copy, (4, 4)),
    _spec("copy64", d.view_u64, d.view_u64, _copy, (8, 8)),
    # same floating dtype, scaled (half types through float32)
    _spec("scale_f32", d.view_f32, d.view_f32, _scale, (4, 4)),
    _spec("scale_f64", d.view_f64, d.view_f64, _scale, (8, 8), "float64"),
    _spec("scale_f16", d.view_f16, d.view_f16, _scale_f16, (2, 2)),
    _spec("scale_bf16", d.view_u16, d.view_u16, _scale_bf16, (2, 2)),
    # casts, with and without scaling (unscaled keeps NaN payloads where the cast does)
    _spec("f32_to_f16", d.view_f32, d.view_f16, _f32_to_f16, (4, 2)),
    _spec("f32_to_f16_scaled", d.view_f32, d.view_f16, _f32_to_f16_scaled, (4, 2)),
    _spec("f32_to_bf16", d.view_f32, d.view_u16, _f32_to_bf16, (4, 2)),
    _spec("f32_to_bf16_scaled", d.view_f32, d.view_u16, _f32_to_bf16_scaled, (4, 2)),
    _spec("f16_to_f32", d.view_f16, d.view_f32, _f16_to_f32, (2, 4)),
    _spec("f16_to_f32_scaled", d.view_f16, d.view_f32, _f16_to_f32_scaled, (2, 4)),
    _spec("bf16_to_f32", d.view_u16, d.view_f32, _bf16_to_f32, (2, 4)),
    _spec("bf16_to_f32_scaled", d.view_u16, d.view_f32, _bf16_to_f32_scaled, (2, 4)),
    # checked packs (floating gradients into the fusion buffer, Inf/NaN flagged per row): the copies
    # are per dtype here, since the finite test reads the format's exponent bits
    _checked("copy_f32_checked", d.view_u32, d.view_u32, _copy, d.bad_f32_bits, (4, 4)),
    _checked("copy_f64_checked", d.view_u64, d.view_u64, _copy, d.bad_f64_bits, (8, 8)),
    _checked("copy_f16_checked", d.view_u16, d.view_u16, _copy, d.bad_f16_bits, (2, 2)),
    _checked("copy_bf16_checked", d.view_u16, d.view_u16, _copy, d.bad_bf16_bits, (2, 2)),
    _checked("scale_f32_checked", d.view_f32, d.view_f32, _scale, d.bad_f32, (4, 4)),
    _checked("scale_f64_checked", d.view_f64, d.view_f64, _scale, d.bad_f64, (8, 8), "float64"),
    _checked("scale_f16_checked", d.view_f16, d.view_f16, _scale_f16, d.bad_f16, (2, 2)),
    _checked("scale_bf16_checked", d.view_u16, d.view_u16, _scale_bf16, d.bad_bf16_bits, (2, 2)),
    _checked("f32_to_f16_checked", d.view_f32, d.view_f16, _f32_to_f16, d.bad_f16, (4, 2)),
    _checked("f32_to_f16_scaled_checked", d.view_f32, d.view_f16, _f32_to_f16_scaled, d.bad_f16, (4, 2)),
    _checked("f32_to_bf16_checked", d.view_f32, d.view_u16, _f32_to_bf16, d.bad_bf16_bits, (4, 2)),
    _checked("f32_to_bf16_scaled_checked", d.view_f32, d.view_u16, _f32_to_bf16_scaled, d.bad_bf16_bits, (4, 2)),
)}


# the finishers, one per slot dtype: (flags address, row-to-tensor address, rows, slot address, limit)
_FINISH_PARAMS = ("uint64", "uint64", "int64", "uint64", "int64")
FINISHERS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("finish_checked_f32", _make_finish_kernel(d.view_f32, _int_f32), "float32", 4, 4, params=_FINISH_PARAMS),
    KernelSpec("finish_checked_f16", _make_finish_kernel(d.view_f16, _int_f16), "float32", 2, 2, params=_FINISH_PARAMS),
    KernelSpec("finish_checked_bf16", _make_finish_kernel(d.view_u16, _int_bf16), "float32", 2, 2,
               params=_FINISH_PARAMS),
    KernelSpec("finish_checked_f64", _make_finish_kernel(d.view_f64, _int_f64), "float64", 8, 8, params=_FINISH_PARAMS),
)}


def select_finisher(slot: torch.dtype) -> KernelSpec:
    """The finisher writing a slot of dtype ``slot`` (a floating dtype); ValueError if none."""
    if slot not in FLOAT_DTYPES:
        raise ValueError(f"the finite check's slot must be a floating tensor (the fusion buffer's dtype), got "
                         f"{dtype_name(slot)}")
    return FINISHERS[f"finish_checked_{FLOAT_DTYPES[slot]}"]


def select_kernel(src: torch.dtype, dst: torch.dtype, scaled: bool, checked: bool = False) -> KernelSpec:
    """The kernel for this (source dtype, destination dtype, scale != 1), the checked pack when
    ``checked`` (floating dtypes only); ValueError if none."""
    return KERNELS[checked_conversion(src, dst, scaled) if checked else conversion(src, dst, scaled)]
