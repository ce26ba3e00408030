"""Rank output: every line a rank writes is echoed with a ``[rank]<stdout>:`` / ``[rank]<stderr>:``
prefix (Horovod's format), optionally copied unprefixed to ``DIR/rank.<N>/stdout|stderr``, and the
last lines of each rank's stderr are kept for the failure report.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, TextIO

STDERR_TAIL_LINES = 20


class OutputSink:
    """Writes the ranks' lines to the launcher's stdout/stderr, whole lines at a time."""

    def __init__(self, size: int, output_dir: str | Path | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None, *, timestamps: bool = False) -> None:
        self._timestamps = timestamps  # horovodrun's --prefix-output-with-timestamp: "<asctime>[rank]<stream>:"
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()
        self._dir = Path(output_dir) if output_dir else None
        self._width = len(str(max(size - 1, 0)))
        self.stderr_tails: collections.defaultdict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=STDERR_TAIL_LINES))  # elastic workers appear later, numbered on
        if self._dir is not None:
            for r in range(size):
                self.rank_dir(r).mkdir(parents=True, exist_ok=True)

    def rank_dir(self, rank: int) -> Path:
        assert self._dir is not None
        return self._dir / f"rank.{rank:0{self._width}d}"

    def pump(self, rank: int, stream: str, pipe: BinaryIO) -> threading.Thread:
        """Start a thread that copies ``pipe`` line by line until it closes."""
        t = threading.Thread(target=self._copy, args=(rank, stream, pipe), name=f"rank{rank}-{stream}", daemon=True)
        t.start()
        return t

    def _copy(self, rank: int, stream: str, pipe: BinaryIO) -> None:
        target = self._out if stream == "stdout" else self._err
        prefix = f"[{rank}]<{stream}>:"
        if self._dir is not None:
            self.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        copy = open(self.rank_dir(rank) / stream, "w", encoding="utf-8") if self._dir is not None else None
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                if stream == "stderr":
                    self.stderr_tails[rank].append(line.rstrip("\n"))
                stamp = time.asctime() if self._timestamps else ""
                with self._lock:
                    target.write(stamp + prefix + line)
                    target.flush()
                if copy is not None:
                    copy.write(line)
                    copy.flush()
        except (OSError, ValueError):  # the pipe was closed under us while stopping
            pass
        finally:
            pipe.close()
            if copy is not None:
                copy.close()

    def say(self, message: str) -> None:
        """A launcher message on stderr, never interleaved inside a rank's line."""
        with self._lock:
            for line in message.rstrip("\n").splitlines():
                self._err.write(f"gpucomm-run: {line}\n")
            self._err.flush()


__all__ = ["OutputSink", "STDERR_TAIL_LINES"]
