"""Device-side building blocks of the pack kernels, in two builds chosen at import time.

* Compiled (normal Numba CUDA): small ``@intrinsic``s turn a uint64 address into a typed global
  pointer and bit-cast float32 <-> uint32; helpers are ``@cuda.jit(device=True, inline="always")``
  because only inlined helpers can be compiled to PTX on a machine without a GPU.
* Simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported): kernels run as Python on
  the host, so an "address" is a host address (a CPU tensor's ``data_ptr()``) and a pointer is a
  NumPy view of exactly ``n`` elements built over it with ctypes; indexing past ``n`` raises
  ``IndexError``, a bounds check the GPU does not give.

Both builds expose the same names with the same meaning, so the kernel bodies are written once.
Numerics: float16/bfloat16 arithmetic happens in float32 (float64 only for float64 data), float
-> float16 is the hardware round-to-nearest-even, float32 -> bfloat16 is round-to-nearest-even on
the bits with every NaN mapped to the quiet NaN 0x7FC0. bfloat16 travels as uint16 bits:
Numba has no bfloat16 type and NumPy can neither view nor convert one.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda
from numba.cuda.core import config as _numba_config

__all__ = [
    "SIMULATOR", "device_function", "view_u8", "view_u16", "view_u32", "view_u64", "view_i32", "view_i64", "view_f16",
    "view_f32", "view_f64", "f32_bits", "bits_f32", "bf16_from_f32", "f32_from_bf16", "to_f16", "to_f32", "mul",
    "bad_f32", "bad_f16", "bad_f64", "bad_f32_bits", "bad_f16_bits", "bad_bf16_bits", "bad_f64_bits",
]

SIMULATOR: bool = bool(_numba_config.ENABLE_CUDASIM)

U16, U32, U64 = np.uint16, np.uint32, np.uint64
_ABS_MASK, _INF_BITS, _BF16_QNAN = U32(0x7FFFFFFF), U32(0x7F800000), U16(0x7FC0)
# exponent all ones (Inf or NaN), per format: a finite check is one AND and one compare
_F16_EXP, _BF16_EXP, _F64_EXP = U32(0x7C00), U32(0x7F80), U64(0x7FF0000000000000)
_ROUND_BIAS, _SIXTEEN, _ONE = U32(0x7FFF), U32(16), U32(1)

if SIMULATOR:

    def device_function(fn):
        return fn  # in the simulator a kernel may call any Python function

    def _make_view(np_dtype):
        itemsize = np.dtype(np_dtype).itemsize

        def view(addr, n):
            n = int(n)
            if n <= 0:
                return np.empty(0, dtype=np_dtype)
            raw = (ctypes.c_char * (n * itemsize)).from_address(int(addr))
            return np.frombuffer(raw, dtype=np_dtype)

        view.__name__ = f"view_{np.dtype(np_dtype).name}"
        return view

    view_u8, view_u16, view_u32, view_u64 = map(_make_view, (np.uint8, np.uint16, np.uint32, np.uint64))
    view_i32, view_i64, view_f16, view_f32, view_f64 = map(_make_view, (np.int32, np.int64, np.float16, np.float32,
                                                                        np.float64))

    def f64_bits(x):
        return np.float64(x).view(np.uint64)

    def f32_bits(x):
        return np.float32(x).view(np.uint32)

    def bits_f32(u):
        return U32(u).view(np.float32)

    # NumPy warns on overflow to inf and on inf*0; the GPU does not, and neither should we.
    def to_f16(x):
        with np.errstate(all="ignore"):
            return np.float16(x)

    def to_f32(x):
        return np.float32(x)

    def mul(x, s):
        with np.errstate(all="ignore"):
            return x * s

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def device_function(fn):
        return cuda.jit(device=True, inline="always")(fn)

    def _make_view(nbtype):
        """An intrinsic ``(addr: uint64, n: int64) -> CPointer(nbtype)``; ``n`` only matters in the
        simulator. The address is cast through addrspace(1) so that loads and stores compile to
        ``ld.global``/``st.global`` rather than generic accesses."""

        @intrinsic
        def view(typingctx, addr, n):
            sig = types.CPointer(nbtype)(types.uint64, types.int64)

            def codegen(context, builder, signature, args):
                elem = context.get_value_type(nbtype)
                glob = builder.inttoptr(args[0], ir.PointerType(elem, 1))
                return builder.addrspacecast(glob, ir.PointerType(elem))

            return sig, codegen

        return view

    view_u8, view_u16, view_u32, view_u64 = map(_make_view, (types.uint8, types.uint16, types.uint32, types.uint64))
    view_i32, view_i64, view_f16, view_f32, view_f64 = map(_make_view, (types.int32, types.int64, types.float16,
                                                                        types.float32, types.float64))

    @intrinsic
    def f64_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(64))

        return types.uint64(types.float64), codegen

    @intrinsic
    def f32_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def bits_f32(typingctx, u):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @device_function
    def to_f16(x):
        return types.float16(x)

    @device_function
    def to_f32(x):
        return types.float32(x)

    @device_function
    def mul(x, s):
        return x * s


@device_function
def bf16_from_f32(x):
    """float32 -> bfloat16 bits (uint16): round to nearest, ties to even; NaN -> 0x7FC0.

    Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
    half is above the tie, or at the tie with an odd kept half; values near the top of the range
    carry into the exponent and become inf, as rounding demands. No step overflows uint32."""
    u = f32_bits(x)
    if (u & _ABS_MASK) > _INF_BITS:
        return _BF16_QNAN
    return U16((u + _ROUND_BIAS + ((u >> _SIXTEEN) & _ONE)) >> _SIXTEEN)


@device_function
def f32_from_bf16(h):
    """bfloat16 bits (uint16) -> float32, exactly (the bits are the top half of a float32)."""
    return bits_f32(U32(U32(h) << _SIXTEEN))


# -- finite checks (the checked pack kernels): True for Inf or NaN, from the bits ------------------
@device_function
def bad_f32_bits(u):
    return (u & _INF_BITS) == _INF_BITS


@device_function
def bad_f16_bits(h):
    return (U32(h) & _F16_EXP) == _F16_EXP


@device_function
def bad_bf16_bits(h):
    return (U32(h) & _BF16_EXP) == _BF16_EXP


@device_function
def bad_f64_bits(u):
    return (u & _F64_EXP) == _F64_EXP


@device_function
def bad_f32(x):
    return bad_f32_bits(f32_bits(x))


@device_function
def bad_f16(x):  # widening to float32 keeps Inf and NaN
    return bad_f32_bits(f32_bits(to_f32(x)))


@device_function
def bad_f64(x):
    return bad_f64_bits(f64_bits(x))
