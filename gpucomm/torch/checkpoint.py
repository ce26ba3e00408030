"""Rank-0 checkpoints written atomically: a crash mid-write never leaves a torn file behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import runtime


def save_checkpoint(obj: Any, path: str | os.PathLike, *, root_rank: int = 0) -> bool:
    """``torch.save(obj)`` to ``path`` on ``root_rank`` only; returns True where it wrote.

    The bytes go to a temporary file in the same directory, are flushed to disk, and replace
    ``path`` with one atomic rename, so readers see the old checkpoint or the new one, never half."""
    rank = runtime.current().world.rank if runtime.is_initialized() else 0
    if rank != root_rank:
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return True


__all__ = ["save_checkpoint"]
