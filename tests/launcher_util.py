"""Running ``gpucomm-run`` (and other launchers) as a real subprocess in tests, with a deadline, and
finding any process a job left behind.

Every job started here carries a unique marker in its environment; after the launcher exits, any
live process whose environment holds the marker is a leftover (and is killed, then reported).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
MARK = "GPUCOMM_TEST_JOB_MARK"
PYTHON = sys.executable


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[str]
    seconds: float


def base_env(mark: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GPUCOMM_START_TIMEOUT="60",
               GPUCOMM_TIMEOUT="60")
    env[MARK] = mark
    env.update(extra)
    return env


def marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def collect_leftovers(mark: str, settle: float = 2.0) -> list[str]:
    """Processes of the job still alive ``settle`` s after the launcher exited; killed, then described."""
    deadline = time.monotonic() + settle
    left = marked_processes(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_processes(mark)
    described = []
    for p in left:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())}")
            p.kill()
        except psutil.Error:
            pass
    return described


def launcher_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "gpucomm.runner", *args]


def run(cmd: list[str], *, timeout: float = 180.0, env: dict[str, str] | None = None, cwd: Path | None = None,
        signal_after: tuple[float, int] | None = None, wait_for_line: str | None = None,
        wait_count: int = 1) -> Result:
    """Run ``cmd`` to completion (killing its group at ``timeout``); optionally send it a signal
    ``signal_after = (seconds, signum)`` once ``wait_count`` stdout lines contain ``wait_for_line``."""
    mark = uuid.uuid4().hex
    env = base_env(mark, **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd or ROOT, start_new_session=True)
    try:
        if signal_after is not None:
            out_lines = _read_until(proc, wait_for_line, wait_count, timeout)
            time.sleep(signal_after[0])
            proc.send_signal(signal_after[1])
            out, err = proc.communicate(timeout=timeout)
            out = "".join(out_lines) + out
        else:
            out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        collect_leftovers(mark, 0)
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    return Result(proc.returncode, out, err, collect_leftovers(mark), seconds)


def _read_until(proc: subprocess.Popen, text: str | None, count: int, timeout: float) -> list[str]:
    lines: list[str] = []
    if text is None:
        return lines
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    seen = 0
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"launcher ended before printing {text!r}:\n{''.join(lines)}{proc.stderr.read()}")
        lines.append(line)
        if text in line:
            seen += 1
            if seen == count:
                return lines
    raise AssertionError(f"{text!r} did not appear within {timeout} s:\n{''.join(lines)}")


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path
