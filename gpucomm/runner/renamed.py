"""Horovod's deprecated argument names (``np`` for ``num_proc``, ``min_np`` for ``min_num_proc``, ...),
accepted with Horovod's own DeprecationWarning wherever its launch functions took them."""

from __future__ import annotations

import warnings
from typing import TypeVar

T = TypeVar("T")


def renamed(old: str, old_value: T | None, new: str, new_value: T) -> T:
    """``old_value`` (warning that ``old`` is deprecated for ``new``, as Horovod does) when it was given,
    else ``new_value``. The warning points at the caller of the function that takes the arguments."""
    if old_value is None:
        return new_value
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=3)
    return old_value


__all__ = ["renamed"]
