"""Gradient compression for the wire (Horovod's ``Compression`` strategy), and PowerSGD's settings
(``Compression.powersgd(...)``; the algorithm runs in ``DistributedOptimizer``'s buckets,
``powersgd.py``)."""

from __future__ import annotations

import math
from typing import Any, Callable

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


class PowerSGD(Compressor):
    """PowerSGD (Vogels et al., NeurIPS 2019) for ``DistributedOptimizer``: each gradient matrix M
    (a weight viewed as ``shape[0] x rest``) travels as two thin factors, P = M Q (rows x rank) and
    Q = M^T P (columns x rank), with this rank's compression error added back into the next step's
    gradient (error feedback) and Q kept from step to step (warm start).

    ``rank``: the approximation's rank (at most ``min(rows, columns)`` per matrix).
    ``start_iter``: steps averaged uncompressed first (DDP's ``start_powerSGD_iter``; early training
    is where a low-rank approximation hurts most). ``min_compression_rate``: a matrix is compressed
    only when ``rows * columns >= min_compression_rate * (rows + columns) * rank``; the rest (biases,
    norms, small matrices) go through the ordinary buckets. ``wire``: ``Compression.none``, ``.fp16``
    or ``.bf16``: the dtype P, Q and the uncompressed buckets travel in. ``seed``: the warm start's
    first Q (the same on every rank). An ad-hoc ``hvd.allreduce(compression=...)`` with this object
    uses ``wire`` only: the low-rank form needs the optimizer's two collectives per step."""

    def __init__(self, rank: int = 4, start_iter: int = 1000, min_compression_rate: float = 2.0,
                 wire: Any = NoneCompressor, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"Compression.powersgd: rank must be a positive integer, got {rank!r}.")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"Compression.powersgd: start_iter must be an integer >= 0 (steps averaged "
                             f"uncompressed first), got {start_iter!r}.")
        if (isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float))
                or not math.isfinite(min_compression_rate) or min_compression_rate < 0):
            raise ValueError(f"Compression.powersgd: min_compression_rate must be a finite number >= 0 (a matrix is "
                             f"compressed when rows * columns >= min_compression_rate * (rows + columns) * rank), got "
                             f"{min_compression_rate!r}.")
        if wire not in (NoneCompressor, FP16Compressor, BF16Compressor):
            raise ValueError(f"Compression.powersgd: wire must be Compression.none, Compression.fp16 or "
                             f"Compression.bf16 (the dtype P, Q and the uncompressed buckets travel in), got {wire!r}.")
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, float(min_compression_rate)
        self.wire, self.seed = wire, int(seed)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.wire.compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.wire.decompress(tensor, ctx)

    def describe(self) -> dict:
        """The settings every rank must share (verified with the optimizer's layout)."""
        return {"rank": self.rank, "start_iter": self.start_iter, "min_compression_rate": self.min_compression_rate,
                "wire": self.wire.__name__, "seed": self.seed}

    def __repr__(self) -> str:
        return "Compression.powersgd(" + ", ".join(f"{k}={v!r}" for k, v in self.describe().items()) + ")"


def resolve(compression: Any) -> Any:
    """``compression`` as the buckets and collectives use it: ``Compression.powersgd`` written without
    its call (as ``Compression.fp16`` is written) means PowerSGD with its defaults."""
    return PowerSGD() if compression is PowerSGD else compression


def wire_of(compression: Any) -> Callable[[torch.dtype], "torch.dtype | None"]:
    """How a DistributedOptimizer's buckets send gradients with ``compression``: a function from a
    gradient's dtype to the dtype it travels in (its own uncompressed; the cast compressor's for
    floating gradients; PowerSGD's ``wire`` for what it leaves uncompressed), or None: a user
    compressor, whose tensors the pack kernels cannot produce (each gradient is compressed)."""
    if isinstance(compression, PowerSGD):
        return wire_of(compression.wire)
    if compression in (None, NoneCompressor):
        return _same
    for builtin in (FP16Compressor, BF16Compressor):
        if compression is builtin or isinstance(compression, builtin):
            wire = builtin.wire_dtype
            return lambda dtype: wire if dtype.is_floating_point else dtype
    return _user


def _same(dtype: torch.dtype) -> torch.dtype:
    return dtype


def _user(dtype: torch.dtype) -> None:
    return None


class Compression:
    """The available compressors, named as in Horovod; ``powersgd(...)`` is gpucomm's."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = PowerSGD
