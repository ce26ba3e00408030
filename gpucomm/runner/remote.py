"""The wrapper ``gpucomm-run`` starts on a remote host through ssh (``python -m gpucomm.runner.remote``).

It reads one JSON line from stdin: the rank's command, working directory, environment (with the
job secret, which therefore never appears on a command line) and the stop grace period. It runs the
command in a new session and ties its life to the ssh connection: when stdin reaches end-of-file
(the launcher closed it, or the connection dropped) or a SIGTERM/SIGHUP/SIGINT arrives, the rank's
whole process tree gets SIGTERM, then SIGKILL after the grace period. Exits with the rank's status.

A connection whose other end dropped off the network (the launcher's host lost its link) brings no
end-of-file: sshd notices only when TCP gives up, after ~15 minutes, or never while idle. So
gpucomm-run writes a newline to every remote rank's stdin every ``BEAT_S`` seconds, and a request
that carries ``silence`` makes the wrapper stop the rank the same way once nothing has arrived for
that long, saying why (the ranks' own control plane normally names the lost host before that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from . import proctree

PROTOCOL = 1
BEAT_S = 5.0  # gpucomm-run writes a newline to a remote rank's stdin this often (Supervisor)
HEARTBEAT = b"\n"
SERVER_ALIVE_S = 10  # the launcher's ssh: ServerAliveInterval ...
SERVER_ALIVE_COUNT = 3  # ... and ServerAliveCountMax: a host that answers nothing is given up after 30-40 s
# An elastic job's workers: given up after 15-20 s, so that a cut host is blacklisted before the survivors'
# liveness check (20 s) asks for a new round, which then forms without it (seen at 35 s with the default above)
ELASTIC_SERVER_ALIVE_S = 5


def encode_request(argv: list[str], cwd: str, env: dict[str, str], grace: float,
                   silence: float | None = None) -> bytes:
    """The single stdin line the launcher sends (newline-terminated JSON). ``silence``: stop the
    rank after that many seconds without a byte from the launcher (it beats every ``BEAT_S``);
    None: only end-of-file stops it (a launcher that sends no heartbeats)."""
    request = {"protocol": PROTOCOL, "argv": argv, "cwd": cwd, "env": env, "grace": grace}
    if silence:
        request["silence"] = silence
    return (json.dumps(request) + "\n").encode()


def _read_request() -> dict[str, Any]:
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit("gpucomm remote wrapper: no request on stdin (the launcher closed the connection)")
    request = json.loads(line)
    if request.get("protocol") != PROTOCOL:
        raise SystemExit(f"gpucomm remote wrapper: request protocol {request.get('protocol')} differs from this "
                         f"host's {PROTOCOL}: install the same gpucomm version on every host.")
    return request


def main() -> int:
    request = _read_request()
    proctree.become_subreaper()
    try:
        os.chdir(request["cwd"])
    except OSError as e:
        print(f"gpucomm remote wrapper on {os.uname().nodename}: cannot enter the launcher's working directory "
              f"{request['cwd']!r}: {e.strerror}. gpucomm-run runs ranks in the same directory on every host: "
              f"use a shared file system or create the same path there.", file=sys.stderr)
        return 126
    try:
        child = subprocess.Popen(request["argv"], env=request["env"], stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(f"gpucomm remote wrapper on {os.uname().nodename}: cannot run {request['argv'][0]!r}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    stop = threading.Event()

    def on_signal(_signum, _frame) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)

    heard = [time.monotonic()]

    def watch_stdin() -> None:
        while sys.stdin.buffer.read1(4096):
            heard[0] = time.monotonic()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    silence = float(request.get("silence") or 0.0)
    while child.poll() is None and not stop.wait(0.1):
        if silence and time.monotonic() - heard[0] > silence:
            print(f"gpucomm remote wrapper on {os.uname().nodename}: nothing heard from gpucomm-run for "
                  f"{silence:g} s (it sends a heartbeat every {BEAT_S:g} s): the launcher's host is unreachable (a "
                  f"cut link, a partition) or the launcher hangs. Stopping the rank (pid {child.pid}) and everything "
                  f"it started, so that nothing is left running here.", file=sys.stderr, flush=True)
            break
    grace = float(request.get("grace", 10.0))
    proctree.terminate_trees([child.pid], grace if child.poll() is None else 0.5, sweep=(os.getpid(),))
    code = child.wait()
    proctree.reap_orphans({child.pid})
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: the stdin watcher thread is blocked in a read
