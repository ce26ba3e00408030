"""Rank-0 checkpoints written atomically: a crash mid-write never leaves a torn file behind.

The bytes go to ``.<name>.<host>.<pid>.<random>.tmp`` beside the target. A writer killed mid-write
leaves that file; the next ``save_checkpoint`` of the same path on the same host removes every
such file whose process is gone (files of live writers, and of other hosts sharing the directory,
are left alone).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from .submission import current_job, job_initialized


def save_checkpoint(obj: Any, path: str | os.PathLike, *, root_rank: int = 0) -> bool:
    """``torch.save(obj)`` to ``path`` on ``root_rank`` only; returns True where it wrote.

    The bytes go to a temporary file in the same directory, are flushed to disk, and replace
    ``path`` with one atomic rename, so readers see the old checkpoint or the new one, never half."""
    rank = current_job().world.rank if job_initialized() else 0
    if rank != root_rank:
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent)
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


def _temp_prefix(path: Path) -> str:
    host = socket.gethostname().replace(".", "_") or "host"
    return f".{path.name}.{host}."


def sweep_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of ``path`` left by writers on this host that no longer run;
    returns what was removed."""
    path = Path(path)
    prefix = _temp_prefix(path)
    removed = []
    for candidate in path.parent.glob(f"{glob_escape(prefix)}*.tmp"):
        pid_text = candidate.name[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        with contextlib.suppress(FileNotFoundError):
            candidate.unlink()
            removed.append(candidate)
    return removed


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


__all__ = ["save_checkpoint", "sweep_stale_temporaries"]
