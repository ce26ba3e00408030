"""What the MPI launcher starts for each rank under ``gpucomm-run --mpi``:
``python .../mpi_rank.py COMMAND...``. It connects this process's stdout and stderr to gpucomm-run
(two TCP connections to ``GPUCOMM_OUTPUT_ADDR:GPUCOMM_OUTPUT_PORT``, each opened with an HMAC of
the run id, rank and stream under the job secret), then replaces itself with ``COMMAND`` (exec: the
MPI process is the command itself, with the launcher's variables and file descriptors). gpucomm-run
thus reads each rank's own byte streams and prefixes whole lines, as when it spawns ranks itself;
MPI launchers' own tags mark every write, not every line, and split lines that arrive in pieces.

Standard library only, and run by path: it needs no installed gpucomm on the rank's host.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import sys

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
CONNECT_TIMEOUT_S = 30.0


def hello(secret: bytes, run_id: str, rank: int, stream: str) -> bytes:
    """The first line a rank sends on an output connection."""
    mac = hmac.new(secret, f"gpucomm-output:{run_id}:{rank}:{stream}".encode(), hashlib.sha256).hexdigest()
    return json.dumps({"run_id": run_id, "rank": rank, "stream": stream, "mac": mac}).encode() + b"\n"


def connect_output(env: dict[str, str]) -> str | None:
    """Point fds 1 and 2 at gpucomm-run; None on success, else why not (output then goes to the
    MPI launcher, untagged)."""
    try:
        rank = int(next(env[v] for v in RANK_VARS if v in env))
        addr, port = env["GPUCOMM_OUTPUT_ADDR"], int(env["GPUCOMM_OUTPUT_PORT"])
        secret, run_id = bytes.fromhex(env["GPUCOMM_SECRET"]), env["GPUCOMM_RUN_ID"]
    except (StopIteration, KeyError, ValueError) as e:
        return f"this process lacks gpucomm-run's variables ({e!r})"
    socks = []
    try:
        for stream in ("stdout", "stderr"):
            sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S)
            sock.sendall(hello(secret, run_id, rank, stream))
            sock.settimeout(None)
            socks.append(sock)
    except OSError as e:
        for sock in socks:
            sock.close()
        return f"cannot reach gpucomm-run's output at {addr}:{port} ({e})"
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, sock in zip((1, 2), socks):
        os.dup2(sock.fileno(), fd)  # inheritable: the command's stdout/stderr after exec
        sock.close()
    return None


def main(argv: list[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("mpi_rank.py: no command given (gpucomm-run --mpi starts it as: mpi_rank.py COMMAND...)")
    problem = connect_output(dict(os.environ))
    if problem is not None:
        sys.stderr.write(f"gpucomm-run --mpi: rank output is not prefixed: {problem}\n")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"gpucomm-run --mpi: cannot run {command[0]!r}: {e.strerror or e}. Check the command and "
                         f"that it is on PATH.\n")
        sys.exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
