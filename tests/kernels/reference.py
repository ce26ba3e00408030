"""The pack/unpack contract written independently of the code under test (NumPy products, torch
casts), special values per dtype, and a bit-level comparison that treats every NaN alike."""

from __future__ import annotations

import numpy as np
import torch

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(x: torch.Tensor, dst_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``cast(x * scale)``: the product in float32 (float64 for float64 data), exactly as the contract says."""
    x = x.reshape(-1)
    if scale == 1.0:
        return x.to(dst_dtype)
    with np.errstate(all="ignore"):
        if torch.float64 in (x.dtype, dst_dtype):
            prod = x.double().numpy() * np.float64(scale)
        else:
            prod = x.float().numpy() * np.float32(scale)
    return torch.from_numpy(prod).to(dst_dtype)


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    return torch.isnan(t) if t.dtype.is_floating_point else torch.zeros(t.shape, dtype=torch.bool)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (NaN bits are not in the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    got_nan, want_nan = nan_mask(got), nan_mask(want)
    assert torch.equal(got_nan, want_nan), f"NaN positions differ at {torch.nonzero(got_nan != want_nan)[:5].tolist()}"
    view = INT_VIEW[got.element_size()] if got.dtype != torch.bool else torch.bool
    a, b = got[~got_nan].view(view), want[~want_nan].view(view)
    if not torch.equal(a, b):
        bad = torch.nonzero(a != b)[:5].flatten().tolist()
        raise AssertionError(f"{int((a != b).sum())} elements differ, e.g. at {bad}: got {got[~got_nan][bad].tolist()} "
                             f"want {want[~want_nan][bad].tolist()}")


def f32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


# float32 bit patterns around bfloat16 rounding: ties to even both ways, just above/below a tie, the
# largest finite float32 (rounds to inf), subnormals (ties included), every NaN class, signed zeros.
BF16_EDGE_BITS = [
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
    0xFF7FFFFF, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF, 0x00800000, 0x7F800000, 0xFF800000, 0x7FC00000,
    0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0x00000000, 0x80000000, 0x3F800000, 0x47800000,
]

# float32 values around float16 rounding and range: max, the overflow threshold (65520 -> inf),
# subnormals and their ties, ties to even at 1.0, float32 extremes, specials.
F16_EDGE_VALUES = [
    0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 65504.0, 65519.99, 65520.0, 1e5, -1e5,
    6.103515625e-05, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-8, 1.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11),
    3.4e38, -3.4e38, 1e-40, -1e-40, 0.1, -2.5,
]


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Edge cases representable in ``dtype`` (float32 covers both cast tables)."""
    f32 = torch.cat([f32_from_bits(BF16_EDGE_BITS), torch.tensor(F16_EDGE_VALUES, dtype=torch.float32)])
    if dtype == torch.float32:
        return f32
    if dtype == torch.float64:
        return torch.cat([f32.double(), torch.tensor([1.7e308, -1.7e308, 5e-324, 1 / 3], dtype=torch.float64)])
    if dtype == torch.float16:  # every float16 with an exponent of 0, 1, 30, 31 plus the usual suspects
        bits = [e << 10 | m for e in (0, 1, 30, 31) for m in (0, 1, 2, 511, 512, 513, 1023)]
        bits += [b | 0x8000 for b in bits]
        return torch.cat([torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16),
                          f32.half()])
    if dtype == torch.bfloat16:
        bits = [e << 7 | m for e in (0, 1, 254, 255) for m in (0, 1, 63, 64, 65, 127)]
        bits += [b | 0x8000 for b in bits]
        return torch.cat([torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
                          f32.bfloat16()])
    raise ValueError(dtype)


def random_values(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` values of ``dtype``: wide-range floats (random bit patterns for half types), full-range ints."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_floating_point:
        if dtype in (torch.float16, torch.bfloat16):
            return torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-12, 12, (n,), generator=gen)).to(dtype)
    info = torch.iinfo(dtype)
    if info.bits == 64:
        return torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64).to(dtype)
    return torch.randint(info.min, info.max + 1, (n,), generator=gen, dtype=torch.int64).to(dtype)
