"""The one way tests start processes: rank functions in a pool of warm rank processes, rank
scripts as fresh processes, and whole commands (``gpucomm-run``, other launchers, fresh
interpreters). Every process has a deadline and is reaped with its children; a failing rank fails
the test with that rank's traceback; stores listen on free ports.

``run_ranks(fn, size)`` runs ``fn`` in ``size`` rank processes. The processes are kept between
calls (a warm pool: each has imported torch and gpucomm once), because starting an interpreter and
importing torch costs more than most scenarios. Between calls a worker shuts gpucomm down and
restores its environment; a worker whose task failed, timed out or died is replaced, so one test's
wreckage never reaches the next. ``fresh=True`` starts new processes for that call instead.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from gpucomm.bootstrap.rendezvous import RendezvousServer

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MARK = "GPUCOMM_TEST_JOB_MARK"  # every process a test starts carries it; leftovers are found by it
FAILURE_GRACE = 10.0  # seconds the other ranks get to report once one rank has failed
STACKS_SIGNAL = signal.SIGUSR1  # a rank that did not finish in time is asked for its threads' stacks first
STACKS_WAIT = 1.0  # seconds it gets to write them
_CTX = mp.get_context("spawn")
# GPUCOMM_TIMEOUT in every rank a test starts; GPUCOMM_TEST_RANK_TIMEOUT shortens it for a run that hunts a hang
RANK_TIMEOUT = os.environ.get("GPUCOMM_TEST_RANK_TIMEOUT", "60")
# The environment as the test session began: a warm rank process starts from it, not from the pytest process's
# environment when the pool happened to start it (which a test running at that moment may have changed).
SESSION_ENV = dict(os.environ)


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each one's traceback."""


def rank_env(rank: int, size: int, port: int, secret: bytes, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``gpucomm-run`` would give ``rank`` of a ``size``-rank job on this host."""
    env = {
        "GPUCOMM_RANK": str(rank), "GPUCOMM_SIZE": str(size),
        "GPUCOMM_LOCAL_RANK": str(rank), "GPUCOMM_LOCAL_SIZE": str(size),
        "GPUCOMM_CROSS_RANK": "0", "GPUCOMM_CROSS_SIZE": "1",
        "GPUCOMM_RENDEZVOUS_ADDR": "127.0.0.1", "GPUCOMM_RENDEZVOUS_PORT": str(port),
        "GPUCOMM_RENDEZVOUS_HOSTED": "1", "GPUCOMM_SECRET": secret.hex(),
        "GPUCOMM_TIMEOUT": RANK_TIMEOUT, "GPUCOMM_START_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


# =============================================================================================
# rank functions in a warm pool


def _stacks_on_signal(path: str) -> None:
    """Write every thread's Python stack to ``path`` on ``STACKS_SIGNAL`` (a hung rank says where it hangs)."""
    stacks = open(path, "w")  # noqa: SIM115 - open for the process's life: the handler writes to it
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)


def _read_stacks(path: str | None) -> str:
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return text[-6000:]


def _serve(conn, mark: str, stacks: str | None = None, session_env: dict[str, str] | None = None) -> None:
    """A pool worker: import once, then run tasks ``(fn, args, env)`` until the pipe closes. It starts from
    ``session_env`` (the pytest process's ``SESSION_ENV``: a spawned child re-imports this module, so its own
    copy would be the environment it inherited)."""
    if stacks:
        _stacks_on_signal(stacks)
    if session_env is not None:
        os.environ.clear()
        os.environ.update(session_env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[MARK] = mark
    import torch  # noqa: PLC0415 - the point of the pool: paid once per worker

    import gpucomm.torch  # noqa: F401, PLC0415

    torch.set_num_threads(1)
    base = dict(os.environ)
    while True:
        try:
            fn, args, env = conn.recv()
        except (EOFError, OSError):
            return
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(env)
        try:
            outcome = ("ok", fn(*args))
        except BaseException:  # report everything, including SystemExit and assertion errors
            outcome = ("error", traceback.format_exc())
        try:
            _reset_worker()
        except BaseException:
            outcome = outcome if outcome[0] == "error" else ("error", "cleanup failed:\n" + traceback.format_exc())
        try:
            conn.send(outcome)
        except Exception:
            conn.send(("error", f"the rank's result could not be sent back:\n{traceback.format_exc()}"))
        if outcome[0] != "ok":
            return  # a failed task may leave threads or sockets behind: the pool starts a new worker


def _reset_worker() -> None:
    """What one task may leave behind: an initialized job, unsynchronized handles, log settings."""
    import logging  # noqa: PLC0415

    from gpucomm import job as jobs  # noqa: PLC0415
    from gpucomm.torch import submission  # noqa: PLC0415

    if jobs.is_initialized():
        jobs.shutdown()
    jobs.reset_process_history()  # a job's ranks count their inits alike; pooled workers have other histories
    submission.clear_handles()
    log = logging.getLogger("gpucomm")
    log.setLevel(logging.NOTSET)
    for handler in [h for h in log.handlers if getattr(h, "_gpucomm", False)]:
        log.removeHandler(handler)


def _entry(fn: Callable[..., Any], env: dict[str, str], args: tuple, conn, stacks: str | None = None) -> None:
    """A fresh rank process (``fresh=True``): one task, then exit."""
    if stacks:
        _stacks_on_signal(stacks)
    os.environ.update(env)
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _stacks_file() -> str:
    fd, path = tempfile.mkstemp(prefix="gpucomm-test-stacks-", suffix=".txt")
    os.close(fd)
    return path


def _remove(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


class _Worker:
    def __init__(self, slot: int, mark: str) -> None:
        self.conn, child = _CTX.Pipe()
        self.stacks = _stacks_file()
        self.proc = _CTX.Process(target=_serve, args=(child, mark, self.stacks, SESSION_ENV), name=f"rank-worker-{slot}",
                                 daemon=True)
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        _kill_tree(self.proc.pid)
        self.proc.join(timeout=10)
        self.conn.close()
        _remove(self.stacks)


class _Pool:
    """Warm rank processes by slot (slot r runs rank r)."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        self.workers: dict[int, _Worker] = {}

    def take(self, slot: int) -> _Worker:
        worker = self.workers.get(slot)
        if worker is None or not worker.alive():
            if worker is not None:
                worker.kill()
            worker = self.workers[slot] = _Worker(slot, self.mark)
        return worker

    def drop(self, slot: int) -> None:
        worker = self.workers.pop(slot, None)
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        for slot in list(self.workers):
            self.drop(slot)


_POOL = _Pool()
atexit.register(_POOL.close)


def run_ranks(fn: Callable[..., Any], size: int, *, args: tuple = (), timeout: float = 120.0,
              env: dict[str, str] | None = None, ranks: Sequence[int] | None = None, fresh: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``ranks`` (default all) of a ``size``-rank job; return their results.

    ``fn`` must be importable (module level). ``fresh``: new processes instead of the warm pool
    (for scenarios that must start from a clean interpreter)."""
    secret = secrets.token_bytes(32)
    ranks = list(range(size)) if ranks is None else list(ranks)
    with RendezvousServer(secret, "127.0.0.1", 0) as server:
        envs = {r: rank_env(r, size, server.port, secret, env) for r in ranks}
        if fresh:
            outcomes = _run_fresh(fn, args, envs, timeout)
        else:
            outcomes = _run_pooled(fn, args, envs, timeout)
    failures = [f"--- rank {r} ---\n{v}" for r, (status, v) in sorted(outcomes.items()) if status != "ok"]
    if failures:
        raise RankFailure(f"{len(failures)} of {len(ranks)} ranks failed:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in ranks]


def _run_pooled(fn, args, envs: dict[int, dict[str, str]], timeout: float) -> dict[int, tuple[str, Any]]:
    pending = {}
    for r, env in envs.items():
        worker = _POOL.take(r)
        worker.conn.send((fn, args, env))
        pending[r] = worker
    outcomes = _collect({r: (w.conn, w.proc) for r, w in pending.items()}, timeout,
                        {r: w.stacks for r, w in pending.items()})
    for r, (status, _) in outcomes.items():
        if status != "ok":
            _POOL.drop(r)  # failed, timed out or died: never reused
    return outcomes


def _run_fresh(fn, args, envs: dict[int, dict[str, str]], timeout: float) -> dict[int, tuple[str, Any]]:
    procs = {}
    stacks = {r: _stacks_file() for r in envs}
    try:
        for r, env in envs.items():
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_entry, args=(fn, dict(env, **{MARK: _POOL.mark}), args, child, stacks[r]),
                             name=f"rank{r}", daemon=True)
            p.start()
            child.close()
            procs[r] = (parent, p)
        return _collect(procs, timeout, stacks)
    finally:
        for path in stacks.values():
            _remove(path)
        for conn, p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                _kill_tree(p.pid)
                p.join(timeout=10)
            conn.close()


def _collect(procs: dict[int, tuple[Any, Any]], timeout: float,
             stacks: dict[int, str] | None = None) -> dict[int, tuple[str, Any]]:
    """Each rank's ("ok", result) or ("error", text) within ``timeout``; once one rank fails, the
    others get ``FAILURE_GRACE`` to report. A rank that did not finish in time is asked for its
    threads' stacks (``stacks``: rank -> the file its handler writes), which its error then shows."""
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[str, Any]] = {}
    pending = dict(procs)
    while pending and time.monotonic() < deadline:
        for r, (conn, p) in list(pending.items()):
            if conn.poll(0.02):
                try:
                    outcomes[r] = conn.recv()
                except EOFError:
                    outcomes[r] = ("error", f"rank {r} exited (code {p.exitcode}) without reporting")
                del pending[r]
                if outcomes[r][0] != "ok":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
            elif not p.is_alive() and not conn.poll(0):
                outcomes[r] = ("error", f"rank {r} died with exit code {p.exitcode} without reporting")
                del pending[r]
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
    asked = []
    for r, (_, p) in pending.items():
        if stacks and stacks.get(r) and p.is_alive():
            with contextlib.suppress(OSError):
                os.kill(p.pid, STACKS_SIGNAL)
                asked.append(r)
    if asked:
        time.sleep(STACKS_WAIT)
    for r in pending:
        where = _read_stacks(stacks.get(r)) if stacks and r in asked else ""
        outcomes[r] = ("error", f"rank {r} did not finish in time (killed)"
                       + (f"; its threads' stacks then:\n{where}" if where else ""))
    return outcomes


# =============================================================================================
# rank scripts and commands as fresh processes


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[str]
    seconds: float


def base_env(mark: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GPUCOMM_START_TIMEOUT="60",
               GPUCOMM_TIMEOUT=RANK_TIMEOUT)
    env[MARK] = mark
    env.update(extra)
    return env


def launcher_cmd(*args: str) -> list[str]:
    return [PYTHON, "-m", "gpucomm.runner", *args]


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def run(cmd: list[str], *, timeout: float = 180.0, env: dict[str, str] | None = None, cwd: Path | None = None,
        signal_after: tuple[float, int] | None = None, wait_for_line: str | None = None,
        wait_count: int = 1) -> Result:
    """Run ``cmd`` to completion in a session of its own (killed, with everything it started, at
    ``timeout``); optionally send it a signal ``signal_after = (seconds, signum)`` once
    ``wait_count`` stdout lines contain ``wait_for_line``. Processes it leaves behind are killed
    and listed in ``Result.leftovers``."""
    mark = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base_env(mark, **(env or {})), cwd=cwd or ROOT, start_new_session=True)
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
        raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout} s\nstdout:\n{out}\n"
                             f"stderr:\n{err}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    return Result(proc.returncode, out, err, collect_leftovers(mark), seconds)


@dataclass
class Started:
    """A process a test talks to while it runs (``started``): ``proc`` is its ``Popen``, ``mark``
    the value every process it starts carries in ``MARK``; ``leftovers`` is filled when the block ends."""

    proc: subprocess.Popen
    mark: str
    leftovers: list[str]


@contextlib.contextmanager
def started(cmd: Sequence[str], *, timeout: float = 180.0, env: dict[str, str] | None = None,
            cwd: Path | None = None, stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE,
            stderr: Any = subprocess.PIPE, inherit_env: bool = False, text: bool = True) -> Any:
    """Start ``cmd`` in a session of its own for a test that interacts with it (reads its output
    as it comes, signals it, feeds its stdin). At ``timeout`` the session is killed even if the
    test is still waiting on it, so a hang fails the test instead of stalling the suite; when the
    block ends, whatever still runs (the process, its children, any process carrying the mark) is
    killed and reaped, and described in ``Started.leftovers``. ``inherit_env``: ``env`` extends
    this process's environment alone (no test defaults), still marked."""
    mark = uuid.uuid4().hex
    full_env = dict(os.environ, **(env or {}), **{MARK: mark}) if inherit_env else base_env(mark, **(env or {}))
    proc = subprocess.Popen(list(cmd), stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=full_env,
                            cwd=cwd or ROOT, start_new_session=True)
    handle = Started(proc, mark, [])
    timer = threading.Timer(timeout, lambda: _kill_session(proc))
    timer.daemon = True
    timer.start()
    try:
        yield handle
    finally:
        timer.cancel()
        _kill_session(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        handle.leftovers = collect_leftovers(mark, 0)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (it was started in one of its own) and reap ``proc``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


def run_rank_scripts(argv: list[str], size: int, *, timeout: float = 60.0,
                     env: dict[str, str] | None = None, store_on_rank0: bool = False,
                     pythons: Sequence[str] | None = None) -> list[Result]:
    """Run ``python *argv`` as every rank of a ``size``-rank job (a real script: an uncaught
    exception goes through ``sys.excepthook``, ``os._exit`` really exits); returns each rank's
    result. Ranks still running at the deadline are killed with their children. ``store_on_rank0``:
    rank 0 serves the rendezvous store itself, as in a launch by hand (mpirun, Slurm, env vars).
    ``pythons``: each rank's interpreter (default this one's), e.g. another virtual environment's."""
    secret = secrets.token_bytes(32)
    mark = uuid.uuid4().hex
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with contextlib.nullcontext(None) if store_on_rank0 else RendezvousServer(secret, "127.0.0.1", 0) as server:
        port = free_port() if store_on_rank0 else server.port
        extra = dict(env or {}, **({"GPUCOMM_RENDEZVOUS_HOSTED": "0"} if store_on_rank0 else {}))
        try:
            for r in range(size):
                procs.append(subprocess.Popen(
                    [pythons[r] if pythons else PYTHON, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env=base_env(mark, **rank_env(r, size, port, secret, extra)), start_new_session=True))
            deadline = time.monotonic() + timeout
            out = []
            for p in procs:
                try:
                    stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    stdout, stderr = p.communicate()
                    stderr += f"\n[harness] rank killed: still running after {timeout} s"
                out.append((p.returncode, stdout, stderr))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
    seconds = time.monotonic() - t0
    left = collect_leftovers(mark)
    return [Result(rc, stdout, stderr, left, seconds) for rc, stdout, stderr in out]


def free_port() -> int:
    """A port nothing listens on now, for a server a test's process will open itself (a store rank 0
    serves). Drawn below the kernel's ephemeral range, which the other tests' connecting sockets and
    port-0 listeners take from, so it stays free between this check and that process's bind (a port
    from the ephemeral range was taken in between once, under the full suite's load)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every draw in use: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# =============================================================================================
# reaping


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
    """Processes of the job still alive ``settle`` s after it ended; killed, then described."""
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


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it."""
    try:
        root = psutil.Process(pid)
        family = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=10)
