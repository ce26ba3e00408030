"""The wrapper ``gpucomm-run`` starts on a remote host through ssh (``python -m gpucomm.runner.remote``).

It reads one JSON line from stdin: the rank's command, working directory, environment (with the
job secret, which therefore never appears on a command line) and the stop grace period. It runs the
command in a new session and ties its life to the ssh connection: when stdin reaches end-of-file
(the launcher closed it, or the connection dropped) or a SIGTERM/SIGHUP/SIGINT arrives, the rank's
whole process tree gets SIGTERM, then SIGKILL after the grace period. Exits with the rank's status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from . import proctree

PROTOCOL = 1


def encode_request(argv: list[str], cwd: str, env: dict[str, str], grace: float) -> bytes:
    """The single stdin line the launcher sends (newline-terminated JSON)."""
    return (json.dumps({"protocol": PROTOCOL, "argv": argv, "cwd": cwd, "env": env, "grace": grace}) + "\n").encode()


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

    def watch_stdin() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while child.poll() is None and not stop.wait(0.1):
        pass
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
