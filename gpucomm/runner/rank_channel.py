"""gpucomm-run's side of the rank channel under ``--mpi``: each rank's wrapper (``mpi_rank.py``)
connects its stdout, its stderr and a status connection here; output lines are copied to the
``OutputSink`` with the rank's prefix, and the status connection says how the rank ended.

Authentication, as the rendezvous store's: every connection gets a fresh 16-byte nonce and must
answer with an HMAC-SHA256 of it (and of the run, rank and stream) under the job secret, so a hello
seen on one connection is refused on any other. Each (rank, stream) is admitted once. The whole
hello, from accept to the last byte, must arrive within ``HELLO_SECONDS`` (a peer trickling bytes
cannot stretch it), and at most ``MAX_PENDING`` connections may be waiting for their hello: beyond
that the oldest is closed, so idle or garbage connections never grow gpucomm-run's threads beyond
that pool plus three per rank, and never keep a real rank out.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..bootstrap.netaddr import listening_socket
from .mpi_rank import ACCEPTED, LINE_MAX_BYTES, MAGIC, NONCE_BYTES, STREAMS, VERSION, hello_mac, status_mac
from .output import OutputSink
from .supervisor import describe_exit

HELLO_SECONDS = 10.0  # accept -> complete hello, in all
MAX_PENDING = 64  # connections not yet through their hello; beyond it the oldest is closed
STATUS_MAX_BYTES = LINE_MAX_BYTES


class HelloRefused(Exception):
    """A connection's hello is late, malformed, unauthenticated, or claims a stream already taken."""


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, in the order gpucomm-run learned it. ``code`` and ``signal`` both None:
    its wrapper's status connection closed without a report (the wrapper was killed, e.g. by the
    MPI launcher stopping the job, or its host was lost)."""

    order: int
    rank: int
    host: str
    code: int | None
    signal: int | None
    after_release: bool = False  # learned once gpucomm-run had begun to end the job: an effect, never a cause

    @property
    def reported(self) -> bool:
        return self.code is not None or self.signal is not None

    @property
    def failed(self) -> bool:
        return self.signal is not None or bool(self.code)

    @property
    def exit_status(self) -> int:
        """As a shell exit status (128 + N after signal N; 1 for a rank that vanished)."""
        if self.signal is not None:
            return 128 + self.signal
        return self.code if self.code is not None else 1

    def describe(self) -> str:
        if self.signal is not None:
            return describe_exit(-self.signal)
        if self.code is not None:
            return describe_exit(self.code)
        return "ended without a report (its wrapper was killed, or the connection to its host was lost)"


class RankEnds:
    """The ranks' ends as they arrive, and the wrappers held after an abnormal end (thread-safe)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ends: dict[int, RankEnd] = {}
        self._held: list[socket.socket] = []
        self._released = False
        self._lock = threading.Lock()

    def record(self, rank: int, host: str, code: int | None, sig: int | None,
               conn: socket.socket | None = None) -> RankEnd:
        """Note rank ``rank``'s end (the first word counts) and return it; ``conn``: the connection
        its wrapper waits on for release (closed at once when the job is released already)."""
        with self._lock:
            end = self._ends.setdefault(rank, RankEnd(len(self._ends), rank, host, code, sig, self._released))
            if conn is not None and not self._released:
                self._held.append(conn)
                conn = None
        if conn is not None:
            _shut(conn)
        return end

    def ends(self) -> list[RankEnd]:
        with self._lock:
            return sorted(self._ends.values(), key=lambda e: e.order)

    def first_failure(self) -> RankEnd | None:
        """The first rank reported to have failed; else the first that vanished; else None (ends
        learned after the release do not count: gpucomm-run or the MPI launcher was stopping them)."""
        ends = [e for e in self.ends() if not e.after_release]
        failed = [e for e in ends if e.failed and e.reported]
        vanished = [e for e in ends if not e.reported]
        return (failed or vanished or [None])[0]

    def running(self) -> list[int]:
        """The ranks whose end has not been learned yet."""
        with self._lock:
            return [r for r in range(self.size) if r not in self._ends]

    def all_ended(self) -> bool:
        with self._lock:
            return len(self._ends) >= self.size

    def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every rank's end; True when all have ended."""
        deadline = time.monotonic() + timeout
        while not self.all_ended():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def release(self) -> None:
        """Let every held wrapper end (and any that reports later end at once)."""
        with self._lock:
            held, self._held, self._released = self._held, [], True
        for conn in held:
            _shut(conn)


class OutputServer:
    """Accepts each rank's stdout, stderr and status connections (``mpi_rank.py`` opens them
    before it starts the command): copies output lines to ``sink`` with the rank's prefix and
    records each rank's end in ``ends``. See the module's docstring for the checks."""

    def __init__(self, sink: OutputSink, addr: str, secret: bytes, run_id: str, size: int, *,
                 hello_seconds: float = HELLO_SECONDS, max_pending: int = MAX_PENDING,
                 on_end: Callable[[RankEnd], None] | None = None) -> None:
        self._sink, self._secret, self._run_id, self._size = sink, secret, run_id, size
        self._hello_seconds, self._max_pending, self._on_end = hello_seconds, max_pending, on_end
        self.ends = RankEnds(size)
        self.pumps: list[threading.Thread] = []
        self._claimed: set[tuple[int, str]] = set()
        self._pending: dict[socket.socket, float] = {}  # accept order: the oldest first
        self._lock = threading.Lock()
        self._listener = listening_socket(addr, 0, backlog=128)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="mpi-output", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Connections waiting for their hello now."""
        with self._lock:
            return len(self._pending)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                evicted = next(iter(self._pending)) if len(self._pending) >= self._max_pending else None
                if evicted is not None:
                    del self._pending[evicted]
                self._pending[conn] = time.monotonic()
            if evicted is not None:
                _shut(evicted)  # its hello thread then ends
            threading.Thread(target=self._admit, args=(conn,), name="mpi-output-hello", daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            nonce = os.urandom(NONCE_BYTES)
            rank, stream = self._hello(conn, nonce, time.monotonic() + self._hello_seconds)
            with self._lock:
                if self._pending.pop(conn, None) is None:
                    raise HelloRefused("evicted meanwhile")
            conn.sendall(ACCEPTED)
        except (OSError, HelloRefused):
            with self._lock:
                self._pending.pop(conn, None)
            _shut(conn)
            return
        if stream == "status":
            self._watch_status(conn, rank, nonce)
        else:
            self.pumps.append(self._sink.pump(rank, stream, conn.makefile("rb")))

    def _hello(self, conn: socket.socket, nonce: bytes, deadline: float) -> tuple[int, str]:
        """Challenge ``conn`` and check its answer, all by ``deadline``; returns (rank, stream)."""
        conn.settimeout(max(0.0, deadline - time.monotonic()))
        conn.sendall(MAGIC + bytes([VERSION]) + nonce)
        line = _read_line(conn, deadline, LINE_MAX_BYTES)
        try:
            msg = json.loads(line)
            rank, stream, run_id, mac = int(msg["rank"]), str(msg["stream"]), str(msg["run_id"]), str(msg["mac"])
        except (ValueError, KeyError, TypeError) as e:
            raise HelloRefused(f"malformed hello ({e})") from None
        if not (0 <= rank < self._size and stream in STREAMS and run_id == self._run_id):
            raise HelloRefused("no such rank or stream in this job")
        if not hmac.compare_digest(mac, hello_mac(self._secret, nonce, run_id, rank, stream)):
            raise HelloRefused("bad MAC")
        with self._lock:
            if (rank, stream) in self._claimed:
                raise HelloRefused(f"rank {rank}'s {stream} is connected already")
            self._claimed.add((rank, stream))
        conn.settimeout(None)
        return rank, stream

    def _watch_status(self, conn: socket.socket, rank: int, nonce: bytes) -> None:
        """Wait for the wrapper's report of how the rank ended (a rank may run for days)."""
        code: int | None = None
        sig: int | None = None
        host = "?"
        try:
            line = _read_line(conn, None, STATUS_MAX_BYTES)
            outer = json.loads(line)
            body = str(outer["body"]).encode()
            if hmac.compare_digest(str(outer["mac"]), status_mac(self._secret, nonce, body)):
                report = json.loads(body)
                code, sig, host = _opt_int(report["code"]), _opt_int(report["signal"]), str(report["host"])
        except (OSError, HelloRefused, ValueError, KeyError, TypeError):
            pass  # closed without a (valid) report: it vanished
        failed = sig is not None or bool(code)
        end = self.ends.record(rank, host, code, sig, conn if failed else None)
        if not failed:
            _shut(conn)
        if self._on_end is not None:
            self._on_end(end)

    def close(self) -> None:
        """Stop accepting (the accept thread ends), release held wrappers, drop unfinished hellos."""
        _shut(self._listener)  # shutdown wakes the thread blocked in accept(); close alone would not
        self.ends.release()
        with self._lock:
            pending = list(self._pending)
        for conn in pending:
            _shut(conn)


def _read_line(conn: socket.socket, deadline: float | None, limit: int) -> bytes:
    """One line (``\\n`` included), read by ``deadline`` (None: no limit) and at most ``limit``
    bytes; nothing may follow it before gpucomm-run answers."""
    buf = b""
    while not buf.endswith(b"\n"):
        if len(buf) >= limit:
            raise HelloRefused(f"no line within {limit} bytes")
        if deadline is None:
            piece = conn.recv(limit - len(buf))
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HelloRefused("hello not complete in time")
            conn.settimeout(left)
            try:
                piece = conn.recv(limit - len(buf))
            except TimeoutError:
                raise HelloRefused("hello not complete in time") from None
        if not piece:
            raise HelloRefused("closed before a whole line")
        buf += piece
        if b"\n" in buf[:-1]:
            raise HelloRefused("bytes after the line")
    return buf


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


__all__ = ["HELLO_SECONDS", "HelloRefused", "MAX_PENDING", "OutputServer", "RankEnd", "RankEnds"]
