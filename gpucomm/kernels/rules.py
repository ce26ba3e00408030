"""What ``pack``/``unpack`` accept: dtypes, casts and argument checks. Imports no numba, so the
CPU path of ``gpucomm.dataplane.bucket_copy`` enforces exactly the same contract as the GPU kernels.

Semantics shared by both paths: element ``i`` of the output is ``cast(x_i * scale)`` where the
product is taken in float32 for float32/float16/bfloat16 data (``scale`` rounded to float32)
and in float64 for float64; with ``scale == 1`` nothing is multiplied (bit copies stay bit
copies). Casts round to nearest even; infinities, signed zeros and subnormals are kept. NaN stays
NaN but its bits are not part of the contract: the kernels write bfloat16 NaN as 0x7FC0, torch
writes 0xFFFF (vectorised CPU) or 0x7FFF (CUDA); float16 NaN payloads follow the hardware cast.
Integers and bool are copied, never scaled.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "FLOAT_DTYPES", "INT_WIDTHS", "CASTS", "checked_conversion", "conversion", "compute_dtype", "tensor_list",
    "validate", "dtype_name",
]

FLOAT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
INT_WIDTHS = {torch.bool: 1, torch.uint8: 1, torch.int8: 1, torch.int16: 2, torch.int32: 4, torch.int64: 8}
for _name, _width in (("uint16", 2), ("uint32", 4), ("uint64", 8)):
    if hasattr(torch, _name):
        INT_WIDTHS[getattr(torch, _name)] = _width
CASTS = ((torch.float32, torch.float16), (torch.float32, torch.bfloat16),
         (torch.float16, torch.float32), (torch.bfloat16, torch.float32))
_COPY = {1: "copy8", 2: "copy16", 4: "copy32", 8: "copy64"}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def conversion(src: torch.dtype, dst: torch.dtype, scaled: bool) -> str:
    """The kernel variant converting ``src`` to ``dst`` (``scaled``: scale != 1); ValueError if none."""
    if src == dst:
        if src in FLOAT_DTYPES:
            return f"scale_{FLOAT_DTYPES[src]}" if scaled else _COPY[src.itemsize]
        if src in INT_WIDTHS:
            if scaled:
                raise ValueError(
                    f"scale != 1 needs a floating dtype, but the tensors are {dtype_name(src)}: integers are only "
                    f"copied. Pass scale=1.0, or scale the integer tensors yourself (torch ops) first.")
            return _COPY[INT_WIDTHS[src]]
    elif (src, dst) in CASTS:
        name = f"{FLOAT_DTYPES[src]}_to_{FLOAT_DTYPES[dst]}"
        return name + "_scaled" if scaled else name
    supported = ", ".join(f"{dtype_name(a)}->{dtype_name(b)}" for a, b in CASTS)
    raise ValueError(
        f"no pack kernel converts {dtype_name(src)} to {dtype_name(dst)}. Any of "
        f"{', '.join(dtype_name(t) for t in [*FLOAT_DTYPES, *INT_WIDTHS])} is copied to the same dtype, and the "
        f"casts are {supported}. Fix: choose the fusion buffer (wire) dtype from these, or convert with torch first.")


def checked_conversion(src: torch.dtype, dst: torch.dtype, scaled: bool) -> str:
    """The checked pack variant (Inf/NaN flagged per piece) converting floating ``src`` to ``dst``."""
    name = conversion(src, dst, scaled)
    if src not in FLOAT_DTYPES or dst not in FLOAT_DTYPES:
        raise ValueError(f"the finite check needs floating tensors, got {dtype_name(src)} -> {dtype_name(dst)}: "
                         f"integers are never Inf or NaN.")
    if name.startswith("copy"):  # bit copies are per width; the check needs the format
        name = f"copy_{FLOAT_DTYPES[src]}"
    return name + "_checked"


def compute_dtype(src: torch.dtype, dst: torch.dtype) -> torch.dtype:
    """The dtype a scaled conversion multiplies in: float64 for float64 data, else float32."""
    return torch.float64 if torch.float64 in (src, dst) else torch.float32


def tensor_list(direction: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``tensors`` as a list (a list or tuple is returned as is); TypeError for a lone tensor."""
    if isinstance(tensors, (list, tuple)):
        return tensors
    if isinstance(tensors, torch.Tensor):
        what = "srcs" if direction == "pack" else "dsts"
        raise TypeError(f"{direction}: {what} must be a sequence of tensors, got one tensor; wrap it in a list.")
    return list(tensors)


def validate(direction: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> tuple[torch.dtype | None, int]:
    """Check one call's arguments; return (the tensors' common dtype or None when empty, total numel).

    ``direction`` is "pack" (tensors are sources, ``flat`` the destination) or "unpack".
    """
    what, flat_name = ("srcs", "dst") if direction == "pack" else ("dsts", "src")
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{direction}: {flat_name} must be a torch.Tensor, got {type(flat).__name__}")
    if not flat.is_contiguous():
        raise ValueError(f"{direction}: {flat_name} must be a contiguous (flat) tensor; got shape "
                         f"{tuple(flat.shape)} with strides {flat.stride()}. Pass a contiguous buffer.")
    tensors = tensor_list(direction, tensors)
    dtypes: set[torch.dtype] = set()
    total = 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{direction}: {what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise ValueError(
                f"{direction}: {what}[{i}] is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                f"pack copies memory in order, which would scramble a strided tensor. Pass {what}[{i}].contiguous() "
                f"(and copy results back), or give the parameter a contiguous gradient.")
        if t.device != flat.device:
            raise ValueError(
                f"{direction}: {what}[{i}] is on {t.device} but {flat_name} is on {flat.device}; one call runs on one "
                f"device. Move them to one device (the fusion planner keeps one device per bucket).")
        dtypes.add(t.dtype)
        total += t.numel()
    if len(dtypes) > 1:
        names = sorted(dtype_name(dt) for dt in dtypes)
        raise ValueError(f"{direction}: all {what} must share one dtype (one launch, one conversion), got {names}. "
                         f"The fusion planner makes one bucket per dtype; call {direction} once per dtype.")
    if total > flat.numel():
        raise ValueError(f"{direction}: {flat_name} holds {flat.numel()} elements but the {what} need {total}. "
                         f"Size the flat buffer to at least the sum of the tensors' numel().")
    return (next(iter(dtypes)) if dtypes else None), total
