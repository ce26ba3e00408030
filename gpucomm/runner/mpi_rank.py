"""What the MPI launcher starts for each rank under ``gpucomm-run --mpi``:
``python .../mpi_rank.py COMMAND...``.

It opens three connections to gpucomm-run's rank channel (``GPUCOMM_OUTPUT_ADDR:PORT``): the rank's
stdout, its stderr, and a status connection of its own. Each opens with a challenge: gpucomm-run
sends ``b"GPCO" + version + 16-byte nonce``, the wrapper answers one line naming the run, rank and
stream with an HMAC-SHA256 of the nonce and those fields under the job secret, and waits for
``OK``. A recorded hello is therefore worth nothing on another connection.

Then it forks: the child points fds 1 and 2 at the first two connections and execs ``COMMAND`` (it
keeps the MPI launcher's variables and file descriptors, PMI's included), so gpucomm-run reads each
rank's own byte streams and prefixes whole lines. The wrapper stays the rank's parent because only a
parent learns how a process ended: it reports the child's exit code or signal on the status
connection (MACed under the same nonce). After an abnormal end it keeps still (holding the MPI
launcher's view of the rank alive) until gpucomm-run releases it, so that MPI's launcher does not
kill the other ranks before gpucomm's control plane has told them which rank died; then it ends the
same way its child did. Signals the wrapper gets (SIGTERM, SIGINT, ...) are passed to the child, and
the child dies with the wrapper (Linux parent-death signal).

Standard library only, and run by path: it needs no installed gpucomm on the rank's host.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import time

# a copy of gpucomm.bootstrap.launch_env.MPI_RANK_VARS (this file cannot import gpucomm; a test keeps them equal)
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
MAGIC = b"GPCO"
VERSION = 2  # 2: a challenge per connection (1 was a fixed HMAC per rank and stream, replayable)
NONCE_BYTES = 16
CHALLENGE_BYTES = len(MAGIC) + 1 + NONCE_BYTES
ACCEPTED = b"OK\n"
STREAMS = ("stdout", "stderr", "status")
LINE_MAX_BYTES = 4096  # a hello or a status line is far shorter
CONNECT_TIMEOUT_S = 30.0  # connect, challenge, hello and acceptance, all of it
HOLD_MAX_S = 300.0  # how long a failed rank's wrapper waits for gpucomm-run's release at most
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def hello_mac(secret: bytes, nonce: bytes, run_id: str, rank: int, stream: str) -> str:
    """The hello's MAC: HMAC-SHA256 under the job secret of this connection's nonce and the fields."""
    text = f"gpucomm-output:{VERSION}:{run_id}:{rank}:{stream}:".encode() + nonce
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def hello(secret: bytes, nonce: bytes, run_id: str, rank: int, stream: str) -> bytes:
    """The line a rank sends after the challenge ``nonce`` on an output or status connection."""
    mac = hello_mac(secret, nonce, run_id, rank, stream)
    return json.dumps({"run_id": run_id, "rank": rank, "stream": stream, "mac": mac}).encode() + b"\n"


def status_mac(secret: bytes, nonce: bytes, body: bytes) -> str:
    """The MAC of a status report on the connection whose challenge was ``nonce``."""
    return hmac.new(secret, b"gpucomm-status:" + nonce + body, hashlib.sha256).hexdigest()


def status_line(secret: bytes, nonce: bytes, code: int | None, sig: int | None, host: str) -> bytes:
    """How the rank ended (exit ``code``, or killed by signal ``sig``), as the wrapper reports it."""
    body = json.dumps({"code": code, "signal": sig, "host": host}, sort_keys=True).encode()
    return json.dumps({"body": body.decode(), "mac": status_mac(secret, nonce, body)}).encode() + b"\n"


def recv_until(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes by ``deadline`` (monotonic); OSError otherwise."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(buf)} of {n} bytes in time")
        sock.settimeout(left)
        piece = sock.recv(n - len(buf))
        if not piece:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += piece
    return buf


def open_connection(addr: str, port: int, secret: bytes, run_id: str, rank: int, stream: str,
                    timeout: float = CONNECT_TIMEOUT_S) -> tuple[socket.socket, bytes]:
    """Connect ``stream`` of ``rank`` to gpucomm-run and pass its challenge; returns the socket and
    the connection's nonce. OSError (ConnectionError when refused) otherwise."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((addr, port), timeout=timeout)
    try:
        challenge = recv_until(sock, CHALLENGE_BYTES, deadline)
        if challenge[:len(MAGIC) + 1] != MAGIC + bytes([VERSION]):
            raise ConnectionError(f"not gpucomm-run's rank channel, or another version (it said {challenge[:5]!r})")
        nonce = challenge[len(MAGIC) + 1:]
        sock.sendall(hello(secret, nonce, run_id, rank, stream))
        if recv_until(sock, len(ACCEPTED), deadline) != ACCEPTED:
            raise ConnectionError("gpucomm-run did not accept the hello")
        sock.settimeout(None)
        return sock, nonce
    except BaseException:
        sock.close()
        raise


def open_channels(env: dict[str, str]) -> tuple[dict[str, tuple[socket.socket, bytes]], str | None]:
    """The three connections (stream -> (socket, nonce)), or ({}, why not)."""
    try:
        rank = int(next(env[v] for v in RANK_VARS if v in env))
        addr, port = env["GPUCOMM_OUTPUT_ADDR"], int(env["GPUCOMM_OUTPUT_PORT"])
        secret, run_id = bytes.fromhex(env["GPUCOMM_SECRET"]), env["GPUCOMM_RUN_ID"]
    except (StopIteration, KeyError, ValueError) as e:
        return {}, f"this process lacks gpucomm-run's variables ({e!r})"
    opened: dict[str, tuple[socket.socket, bytes]] = {}
    try:
        for stream in STREAMS:
            opened[stream] = open_connection(addr, port, secret, run_id, rank, stream)
    except OSError as e:
        for sock, _ in opened.values():
            sock.close()
        return {}, f"cannot reach gpucomm-run's rank channel at {f'[{addr}]' if ':' in addr else addr}:{port} ({e})"
    return opened, None


def close_inherited_listeners() -> None:
    """Close listening sockets inherited from the MPI launcher (MPICH's Hydra leaks its control
    port's listener into every rank): the rank should hold only the listeners it opens itself."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd <= 2:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket (or already gone)
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        finally:
            sock.detach()
        if listening:
            os.close(fd)


def die_with_parent() -> None:
    """(in the child) SIGKILL this process when the wrapper dies (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


def start_command(command: list[str], out: socket.socket, err: socket.socket) -> int:
    """Fork; the child execs ``command`` with fds 1 and 2 on ``out`` and ``err``; returns its pid.
    The signals the wrapper forwards are blocked across the fork and unblocked only once the parent
    forwards them (so none sent meanwhile is lost) and the child has its default handlers back."""
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    pid = os.fork()
    if pid:
        forward_signals(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        return pid
    try:  # the child: nothing here may return into the wrapper's code
        die_with_parent()
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)  # the wrapper died before the signal was armed
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.execvp(command[0], command)
    except OSError as e:
        os.write(2, f"gpucomm-run --mpi: cannot run {command[0]!r}: {e.strerror or e}. Check the command and that "
                    f"it is on PATH.\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    finally:
        os._exit(126)


def forward_signals(child: int) -> None:
    """Pass the signals a process manager sends the wrapper on to the rank."""
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)


def wait_for(pid: int) -> tuple[int | None, int | None]:
    """(exit code, None) or (None, signal) of child ``pid`` once it has ended."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status), None


def hold(sock: socket.socket, limit: float = HOLD_MAX_S) -> None:
    """Wait until gpucomm-run releases this rank (closes the status connection or sends a byte)."""
    sock.settimeout(limit)
    try:
        sock.recv(1)
    except OSError:
        pass


def end_like(code: int | None, sig: int | None) -> None:
    """Exit as the child did: with its code, or killed by its signal (so the MPI launcher sees the same)."""
    if sig is not None:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP keep their default action anyway
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default
    sys.exit(code)


def supervise(command: list[str], channels: dict[str, tuple[socket.socket, bytes]], secret: bytes) -> None:
    """Run ``command`` as this rank's process, report how it ended, and end the same way."""
    child = start_command(command, channels["stdout"][0], channels["stderr"][0])
    for stream in ("stdout", "stderr"):
        channels[stream][0].close()  # only the rank (and what it starts) writes there
    code, sig = wait_for(child)
    for forwarded in FORWARDED_SIGNALS:  # the child is reaped: its pid may be reused, so stop forwarding
        signal.signal(forwarded, signal.SIG_DFL)
    status, nonce = channels["status"]
    try:
        status.sendall(status_line(secret, nonce, code, sig, socket.gethostname()))
        if sig is not None or code:
            hold(status)
    except OSError:
        pass  # gpucomm-run is gone; nobody to tell
    status.close()
    end_like(code, sig)


def main(argv: list[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("mpi_rank.py: no command given (gpucomm-run --mpi starts it as: mpi_rank.py COMMAND...)")
    close_inherited_listeners()
    env = dict(os.environ)
    channels, problem = open_channels(env)
    if problem is None:
        supervise(command, channels, bytes.fromhex(env["GPUCOMM_SECRET"]))
        return
    sys.stderr.write(f"gpucomm-run --mpi: rank output is not prefixed and its end is not reported: {problem}\n")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"gpucomm-run --mpi: cannot run {command[0]!r}: {e.strerror or e}. Check the command and "
                         f"that it is on PATH.\n")
        sys.exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
