"""Stopping whole process trees, so that no rank's helper process outlives the job.

Each rank is started as the leader of a new session (its own process group). Signals go to that
group, and also to every descendant found through psutil, which catches processes that left the
group with ``setsid``. The launcher makes itself a *child subreaper* (Linux), so a grandchild
orphaned by its parent is re-parented to the launcher rather than to init and is still found.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

import psutil

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux ``prctl``); False where the platform lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent_hook(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` that makes the child receive ``sig`` when the launcher dies (Linux
    ``PR_SET_PDEATHSIG``), so a SIGKILLed launcher leaves no ranks behind; None elsewhere.

    The kernel sends it when the *thread* that forked exits, so spawn from a thread that lives as
    long as the job (the supervisor's). The hook only calls a function pointer resolved here, in the
    parent: a forked child of a threaded process must not allocate or take locks."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)

    return hook


def descendants(pid: int) -> list[psutil.Process]:
    """Every living descendant of ``pid`` (empty when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, ignoring a group that no longer exists."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_processes(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_stop_handlers(handler) -> dict[int, object]:
    """Route Ctrl-C, SIGTERM and SIGHUP to ``handler`` (main thread only); returns the previous
    handlers for ``restore_handlers``."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def restore_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def terminate(pids: list[int]) -> dict[int, list[psutil.Process]]:
    """SIGTERM each process's group and its descendants (taken first: they may leave the group);
    returns those descendants, to be killed later if they linger."""
    trees = {pid: descendants(pid) for pid in pids}
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
        signal_processes(trees[pid], signal.SIGTERM)
    return trees


def kill_all(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """SIGKILL ``procs`` and wait until they are dead; returns those still alive after ``timeout``.

    Waits by polling, never by ``waitpid``: some of ``procs`` are children whose exit status a
    ``subprocess.Popen`` must still collect (psutil's ``wait`` would reap them and lose it)."""
    signal_processes(procs, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.02)
    return [p for p in procs if alive(p)]


def reap_orphans(keep: set[int]) -> None:
    """Collect the exit status of adopted orphans (children of ours not in ``keep``), so none stays
    a zombie; ``keep`` holds the pids that ``subprocess`` waits for itself."""
    for child in descendants(os.getpid()):
        if child.pid in keep:
            continue
        try:
            if child.ppid() == os.getpid():
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            pass


def terminate_trees(leaders: list[int], grace: float, sweep: tuple[int, ...] = ()) -> None:
    """Stop the session leaders ``leaders`` and all their descendants, plus every descendant of the
    processes in ``sweep`` (the launcher passes itself: orphans it adopted are found there).

    SIGTERM to each group and process, then, after up to ``grace`` s, SIGKILL to whatever is still
    alive; descendants are looked up again first, so processes forked meanwhile are caught too."""
    procs: dict[int, psutil.Process] = {}

    def collect() -> None:
        for pid in leaders:
            try:
                procs.setdefault(pid, psutil.Process(pid))
            except psutil.Error:
                pass
        for pid in (*leaders, *sweep):
            for d in descendants(pid):
                procs.setdefault(d.pid, d)

    collect()
    for pid in leaders:
        signal_group(pid, signal.SIGTERM)
    signal_processes(list(procs.values()), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in procs.values()):
        time.sleep(0.05)
    collect()
    for pid in leaders:
        signal_group(pid, signal.SIGKILL)
    kill_all([p for p in procs.values() if alive(p)])


def stop_and_reap(procs: Sequence[subprocess.Popen], grace: float, *, terminate_pids: Sequence[int] | None = None,
                  close_stdin: Callable[[subprocess.Popen], None] | None = None,
                  interrupted: Callable[[], bool] = lambda: False,
                  on_kill: Callable[[list[subprocess.Popen]], None] | None = None) -> list[subprocess.Popen]:
    """Stop the launcher's children ``procs`` (session leaders) and reap them: the one stop sequence of
    gpucomm-run's supervisors. ``close_stdin`` is called on each first (a remote wrapper takes EOF as
    "terminate"); then SIGTERM to the groups and trees of ``terminate_pids`` (default: every one of
    ``procs``); up to ``grace`` s (or until ``interrupted()``) for them to exit; SIGKILL to the groups
    still alive (``on_kill`` is told which first) and to every process of the trees; finally each
    exit status is collected. Returns those that did not exit even after SIGKILL."""
    if close_stdin is not None:
        for p in procs:
            close_stdin(p)
    trees = terminate(list(terminate_pids) if terminate_pids is not None else [p.pid for p in procs])
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not interrupted():
        time.sleep(0.05)
    leftover = [p for p in procs if p.poll() is None]
    if leftover and on_kill is not None:
        on_kill(leftover)
    for p in leftover:
        signal_group(p.pid, signal.SIGKILL)
    kill_all([d for tree in trees.values() for d in tree] +
             [d for p in leftover for d in [*_process(p.pid), *descendants(p.pid)]])
    stuck = []
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stuck.append(p)
    return stuck


def _process(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid)]
    except psutil.Error:
        return []


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


__all__ = ["alive", "become_subreaper", "descendants", "kill_all", "reap_orphans", "signal_group",
           "signal_processes", "stop_and_reap", "terminate_trees"]
