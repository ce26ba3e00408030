"""Gradient compression for the wire (Horovod's ``Compression`` strategy)."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(t) -> (t, ctx)`` before the collective, ``decompress(t, ctx)`` after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    """Floating tensors travel as float16 (half the bytes); others are untouched."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors travel as bfloat16: float32's range, so no overflow in large sums."""

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
