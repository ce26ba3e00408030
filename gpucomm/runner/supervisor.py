"""Runs the ranks and stops the job as soon as one fails.

Fail-fast supervision: the first rank that exits non-zero decides the job's exit code. The other
ranks get SIGTERM (a remote rank: its ssh stdin is closed, and the remote wrapper terminates the
rank), then, after a grace period, SIGKILL of their whole process tree. A signal to the launcher
(Ctrl-C, SIGTERM, SIGHUP) stops every rank the same way. Nothing is left running afterwards: the
launcher is a child subreaper, so even processes that escaped a rank's process group are found.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Callable

import psutil

from . import proctree
from ..failures import Failure
from ..bootstrap.placement import Placement
from .output import OutputSink
from .remote import BEAT_S, HEARTBEAT, SERVER_ALIVE_COUNT, SERVER_ALIVE_S

SSH_UNREACHABLE = 255  # ssh's own exit code when it cannot connect or authenticate
REMOTE_EXTRA_GRACE = 5.0  # seconds a remote rank gets beyond the grace to report its exit over ssh


@dataclass
class Launch:
    """How to start one rank: ``argv`` with ``env``; a remote rank's ``stdin_payload`` (its
    environment and command for the remote wrapper) is written to its stdin, which stays open."""

    slot: Placement
    argv: list[str]
    env: dict[str, str]
    remote: bool = False
    stdin_payload: bytes | None = None


@dataclass
class _Running:
    launch: Launch
    proc: subprocess.Popen | None = None
    exit_code: int | None = None
    start_error: bool = False
    pumps: list[threading.Thread] = field(default_factory=list)


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status (killed by signal N → 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = " (SIGKILL from outside the job is often the kernel's out-of-memory killer; see dmesg)" \
            if sig == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {returncode}"


class Supervisor:
    """Start ``launches``, copy their output to ``sink``, and return the job's exit status."""

    def __init__(self, launches: list[Launch], sink: OutputSink, *, grace: float = 10.0,
                 verbose: bool = False, reported_failures: Callable[[], list[Failure]] = list) -> None:
        self._ranks = [_Running(launch) for launch in launches]
        self._sink = sink
        self._grace = grace
        self._verbose = verbose
        self._reported_failures = reported_failures
        self._events: queue.Queue[tuple[int, int]] = queue.Queue()
        self._signal: int | None = None
        self._signals_seen = 0
        self._first_failure: tuple[int, int] | None = None  # (rank, returncode)
        self._die_with_launcher = proctree.die_with_parent_hook()  # a SIGKILLed launcher takes its ranks along
        self._stdin_lock = threading.RLock()  # a remote rank's stdin: its request, heartbeats, the stop's close

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        proctree.become_subreaper()
        previous = proctree.install_stop_handlers(self._on_signal)
        beating = self._beat_remote_ranks()
        try:
            self._start_all()
            self._watch()
        finally:
            beating.set()
            try:
                self._stop_all()  # a second signal meanwhile means "kill now", so handlers stay ours
                self._sweep_leftovers()
            finally:
                proctree.restore_handlers(previous)
            for r in self._ranks:
                for t in r.pumps:
                    t.join(timeout=5)
        return self._report()

    @property
    def stderr_tails(self) -> dict:
        """The last lines each rank wrote to stderr (rank -> lines)."""
        return self._sink.stderr_tails

    @property
    def first_failure(self) -> tuple[int, int] | None:
        """(rank, Popen return code) of the first rank that failed; None while none has."""
        return self._first_failure

    # ------------------------------------------------------------------ starting

    def _start_all(self) -> None:
        for r in self._ranks:
            if self._signal is not None or self._first_failure is not None:
                return
            self._start(r)

    def _start(self, r: _Running) -> None:
        launch = r.launch
        rank = launch.slot.rank
        try:
            with self._stdin_lock:  # a heartbeat must not go before the request
                r.proc = subprocess.Popen(
                    launch.argv, env=launch.env, start_new_session=True, preexec_fn=self._die_with_launcher,
                    stdin=subprocess.PIPE if launch.stdin_payload is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                if launch.stdin_payload is not None:
                    self._write_stdin(r.proc, launch.stdin_payload)
        except OSError as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            self._sink.say(f"rank {rank} on {launch.slot.host} could not be started: cannot run "
                           f"{launch.argv[0]!r}: {e.strerror or e}. Check the command and that it is on PATH.")
            r.exit_code = code
            r.start_error = True
            self._first_failure = (rank, code)
            return
        r.pumps = [self._sink.pump(rank, "stdout", r.proc.stdout), self._sink.pump(rank, "stderr", r.proc.stderr)]
        threading.Thread(target=self._wait, args=(rank, r.proc), name=f"rank{rank}-wait", daemon=True).start()
        if self._verbose:
            where = f"ssh to {launch.slot.host}" if launch.remote else "local"
            self._sink.say(f"started rank {rank} ({where}, pid {r.proc.pid})")

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        self._events.put((rank, proc.wait()))

    def _beat_remote_ranks(self) -> threading.Event:
        """Write a heartbeat to every running remote rank's stdin every ``BEAT_S`` s (its wrapper
        stops the rank when they cease: ``remote.py``) until the returned event is set."""
        done = threading.Event()
        if not any(r.launch.remote for r in self._ranks):
            return done

        def beat() -> None:
            while not done.wait(BEAT_S):
                for r in self._ranks:
                    if r.launch.remote and r.proc is not None and r.proc.stdin is not None:
                        self._write_stdin(r.proc, HEARTBEAT)

        threading.Thread(target=beat, name="remote-heartbeats", daemon=True).start()
        return done

    def _write_stdin(self, proc: subprocess.Popen, data: bytes) -> None:
        with self._stdin_lock:
            try:
                if not proc.stdin.closed:
                    proc.stdin.write(data)
                    proc.stdin.flush()
            except (OSError, ValueError):
                pass  # ssh exited (its status says why) or the stop closed it meanwhile

    # ------------------------------------------------------------------ watching

    def _watch(self) -> None:
        while any(r.exit_code is None for r in self._ranks):
            if self._signal is not None or self._first_failure is not None:
                return
            try:
                rank, code = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._ranks[rank].exit_code = code
            if self._verbose:
                self._sink.say(f"rank {rank} {describe_exit(code)}")
            if code != 0 and self._first_failure is None:
                self._first_failure = (rank, code)
                others = sum(1 for r in self._ranks if r.exit_code is None)
                host = self._ranks[rank].launch.slot.host
                self._sink.say(f"rank {rank} on {host} {describe_exit(code)}; stopping the other {others} "
                               f"rank(s) (SIGTERM, then SIGKILL after {self._grace:g} s).")
                return

    # ------------------------------------------------------------------ stopping

    def _on_signal(self, signum: int, _frame) -> None:
        # Only plain assignments here: a handler must not take locks the main thread may hold.
        self._signals_seen += 1
        if self._signal is None:
            self._signal = signum

    def _alive(self) -> list[_Running]:
        return [r for r in self._ranks if r.proc is not None and r.proc.poll() is None]

    def _stop_all(self) -> None:
        """SIGTERM every running rank (remote: close its stdin), wait out the grace, then SIGKILL."""
        running = self._alive()
        if not running:
            return
        if self._signal is not None:
            self._sink.say(f"received {signal.Signals(self._signal).name}; stopping all {len(running)} running "
                           f"rank(s).")
        signals_before = self._signals_seen
        remote_pids = {r.proc.pid for r in running if r.launch.remote}

        def close_stdin(proc: subprocess.Popen) -> None:
            if proc.pid in remote_pids and proc.stdin is not None:
                with self._stdin_lock:
                    try:
                        proc.stdin.close()  # the remote wrapper sees EOF and terminates the rank
                    except OSError:
                        pass

        def on_kill(_leftover: list[subprocess.Popen]) -> None:
            if self._signals_seen != signals_before:
                self._sink.say("second signal: killing all ranks now.")

        stuck = proctree.stop_and_reap(
            [r.proc for r in running], self._grace + (REMOTE_EXTRA_GRACE if remote_pids else 0.0),
            terminate_pids=[r.proc.pid for r in running if not r.launch.remote], close_stdin=close_stdin,
            interrupted=lambda: self._signals_seen != signals_before, on_kill=on_kill)
        for r in running:
            if r.proc in stuck:
                self._sink.say(f"rank {r.launch.slot.rank} (pid {r.proc.pid}) did not exit even after SIGKILL.")

    def _sweep_leftovers(self) -> None:
        """Terminate processes that outlived their rank (orphans adopted by this launcher)."""
        keep = {r.proc.pid for r in self._ranks if r.proc is not None}
        orphans = [p for p in proctree.descendants(os.getpid()) if p.pid not in keep]
        if orphans:
            if self._verbose:
                self._sink.say(f"stopping {len(orphans)} process(es) left behind by finished ranks")
            proctree.signal_processes(orphans, signal.SIGTERM)
            _, alive = psutil.wait_procs(orphans, timeout=min(self._grace, 2.0))  # orphans are ours to reap
            proctree.kill_all(alive)
        proctree.reap_orphans(keep)

    # ------------------------------------------------------------------ reporting

    def _report(self) -> int:
        if self._first_failure is None:
            return 128 + self._signal if self._signal is not None else 0
        rank, code = self._first_failure
        reported = self._reported_failures()
        root = reported[0] if reported else None
        if code < 0 and not any(f.rank == rank for f in reported):
            # killed by a signal before the launcher stopped anyone, and it reported nothing itself: the
            # errors the others reported (a peer lost, a collective broken) are echoes of this death
            root = None
        lines = []
        if root is not None and 0 <= root.rank < len(self._ranks) and root.rank != rank:
            # the first rank to exit only echoed another rank's failure: report the cause first
            lines.append(f"rank {root.rank} on {self._ranks[root.rank].launch.slot.host} failed first: {root.error}")
            lines.append(f"(rank {rank} exited before it, with code {exit_status(code)}, after that failure)")
            rank = root.rank
        elif root is not None and root.rank == rank:
            lines.append(f"rank {rank} failed with {root.error}")
        slot = self._ranks[rank].launch.slot
        tail = list(self._sink.stderr_tails[rank])
        if tail:
            lines.append(f"last {len(tail)} line(s) of rank {rank}'s stderr:")
            lines += [f"  | {t}" for t in tail]
        if self._ranks[rank].launch.remote and code == SSH_UNREACHABLE:
            lines.append(f"exit code 255 is ssh's own: it could not reach or log in to {slot.host}, or it lost the "
                         f"connection (no answer from {slot.host} for {SERVER_ALIVE_S * SERVER_ALIVE_COUNT} s or more: "
                         f"a cut link, a partition, a host that went down). Check that `ssh {slot.host.replace('[', '').replace(']', '')} true` works "
                         f"without a password prompt (key in ~/.ssh, -i, -p) and that the host is up.")
        proc = self._ranks[rank].proc
        own = proc.returncode if proc is not None else None
        if rank != self._first_failure[0] and own is not None and own > 0:
            code = own  # the root cause's own exit status, when it exited by itself
        if self._ranks[rank].start_error:
            how = f"could not be started (code {code}) (the first rank to fail)"
        elif rank == self._first_failure[0]:
            how = f"{describe_exit(code)} (the first rank to fail)"
        else:
            how = f"raised the job's first error ({root.error})"
        lines.append(f"job failed: rank {rank} on {slot.host} {how}; gpucomm-run exits with {exit_status(code)}.")
        self._sink.say("\n".join(lines))
        return exit_status(code)


__all__ = ["Launch", "Supervisor", "describe_exit", "exit_status"]
