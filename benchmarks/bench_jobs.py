"""Stopping the jobs the benchmark drivers start (shared by control_plane.py and verify_gpu.py)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM ``proc``'s process group (a launcher then stops its ranks, which run in sessions of their
    own, so a SIGKILL of the group alone would orphan them), and SIGKILL it after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


__all__ = ["stop_group"]
