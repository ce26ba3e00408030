"""Horovod's reduction codes, importable without torch (the control plane and the launcher use them)."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """Horovod's reduction codes (hvd.Average == 0 ... hvd.Product == 5)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


__all__ = ["ReduceOp"]
