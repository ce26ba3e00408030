"""The synchronizing CUDA calls a block of code makes, and who made them.

A host that waits for the GPU in the middle of a step (a ``.item()``, a ``.tolist()`` or ``bool()`` of a
CUDA tensor, any blocking copy between host and device, a stream synchronize) loses the lead it had over the GPU: the
GPU then idles while the host queues the next kernels, and the wait is counted as the host's CPU time
too (the CUDA runtime spins while it waits). A step that should queue its work and return must make
none. torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every such call in
torch; ``SyncRecorder`` turns those warnings, from every thread, into records with the Python stack
that made the call, so a report can name the line. Not seen by torch's mode: event and device
synchronizes (gpucomm's pinned upload ring waits on an event when the host runs three rebases ahead of
the GPU, ``kernels/table.py``), non-blocking copies from pageable memory, and CUDA calls made by CuPy or
Numba; the step's issue time (``step_profile.py``) shows any wait, whoever made it.
"""

from __future__ import annotations

import os
import threading
import traceback
import warnings
from collections import Counter
from typing import Any

__all__ = ["SYNC_WARNING", "SyncRecorder"]

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text (c10/cuda warn_or_error_on_sync)


class SyncRecorder:
    """Inside ``with``: torch's sync debug mode warns, and each warning about a synchronizing call is
    recorded with its stack (``records``: ``(thread name, [frame, ...])``, innermost frame last) instead of
    printed; other warnings are shown as before. ``package``: a directory whose frames ``ours`` picks out
    (e.g. gpucomm's)."""

    def __init__(self, package: str) -> None:
        self.package = os.path.abspath(package) + os.sep
        self.records: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()
        self._catch: Any = None
        self._mode = 0

    def __enter__(self) -> "SyncRecorder":
        import torch  # noqa: PLC0415 - only where CUDA is used

        self._mode = torch.cuda.get_sync_debug_mode()  # first: it raises where CUDA cannot start, changing nothing
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on the way out
        self._catch.__enter__()
        shown = warnings.showwarning
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_WARNING not in str(message):
                shown(message, category, filename, lineno, file, line)
                return
            frames = [f"{f.filename}:{f.lineno}({f.name})" for f in traceback.extract_stack()[:-2]]
            with self._lock:
                self.records.append((threading.current_thread().name, frames))

        warnings.showwarning = show
        try:
            torch.cuda.set_sync_debug_mode("warn")
        except BaseException:
            self._catch.__exit__(None, None, None)
            self._catch = None
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch  # noqa: PLC0415

        torch.cuda.set_sync_debug_mode(self._mode)
        assert self._catch is not None
        self._catch.__exit__(*exc)
        self._catch = None

    def ours(self) -> list[tuple[str, list[str]]]:
        """The records whose stack passes through ``package``."""
        return [(thread, frames) for thread, frames in self.records if any(f.startswith(self.package) for f in frames)]

    def by_line(self, records: list[tuple[str, list[str]]] | None = None) -> Counter:
        """How many records each innermost ``package`` frame (else the innermost frame) made."""
        counts: Counter = Counter()
        for _, frames in self.records if records is None else records:
            mine = [f for f in frames if f.startswith(self.package)]
            where = (mine or frames or ["?"])[-1]
            counts[os.path.relpath(where, os.path.dirname(self.package.rstrip(os.sep)))
                   if where.startswith(self.package) else where] += 1
        return counts
