"""The rendezvous store under attack: garbage, truncated, oversized, slow and thousands of idle
connections. The server (in its own process, so its memory can be read) must stay small, close
what never authenticates within its deadline, and keep serving a valid rank throughout."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import subprocess
import time

import psutil
import pytest

from gpucomm.bootstrap.framing import HELLO_BYTES
from gpucomm.bootstrap.rendezvous import FIRST_FRAME_SECONDS, RendezvousClient
from tests.harness import PYTHON, started

SECRET = b"fuzz-test-secret-0123456789abcdef"
SERVER = f"""
import json, sys
from gpucomm.bootstrap.rendezvous import RendezvousServer
server = RendezvousServer({SECRET!r}, host="127.0.0.1")
print(server.port, flush=True)
for _ in sys.stdin:  # each line the test writes asks for the refusal counts; serve until it closes our stdin
    print(json.dumps(server.refusal_counts()), flush=True)
"""
WAIT = FIRST_FRAME_SECONDS + 30  # the longest the test waits for a connection to be closed (a hang guard)


def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 8192) if hard != resource.RLIM_INFINITY else 8192
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@pytest.fixture
def store():
    limit = _raise_fd_limit()  # inherited by the server process
    with started([PYTHON, "-c", SERVER], stdin=subprocess.PIPE, stderr=None, timeout=600) as server:
        port = int(server.proc.stdout.readline())
        yield server.proc, port, limit


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.recv(HELLO_BYTES, socket.MSG_WAITALL)
    return s


def _refusals(proc: subprocess.Popen) -> dict[str, int]:
    """The server's refusal counts by cause (RendezvousServer.refusal_counts)."""
    proc.stdin.write("counts\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _closed(s: socket.socket, timeout: float = WAIT) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(64) in (b"", b"\x00\x00\x00\x00DENY")
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _valid_round_trip(port: int, key: str) -> float:
    t0 = time.monotonic()
    client = RendezvousClient("127.0.0.1", port, SECRET, connect_timeout=20, timeout=20)
    client.set(key, b"v")
    assert client.get(key) == b"v"
    client.close()
    return time.monotonic() - t0


def test_attacks_leave_the_store_small_and_serving(store):
    proc, port, fd_limit = store
    server = psutil.Process(proc.pid)
    rss_before = server.memory_info().rss
    attackers: list[socket.socket] = []
    # oversized: a header claiming 64 MiB, before any authentication: refused for its size, not left to its deadline
    oversized = [_connect(port) for _ in range(8)]
    for s in oversized:
        s.sendall(struct.pack(">I", 64 << 20) + b"x" * 100)
    assert all(_closed(s) for s in oversized), "an oversized unauthenticated frame was not refused"
    refused = _refusals(proc)
    assert refused["bad_frame"] == 8 and refused["first_frame_deadline"] == 0, refused
    # garbage and truncated frames, and a slow one (1 byte a second)
    for i in range(50):
        s = _connect(port)
        s.sendall(os.urandom(300) if i % 2 else struct.pack(">I", 200) + b"y" * 20)
        attackers.append(s)
    slow = _connect(port)
    slow.sendall(b"\x00")
    slow_closed = False
    # thousands of idle connections that never send a byte
    idle = [_connect(port) for _ in range(min(2000, fd_limit // 2 - 300))]
    latencies = [_valid_round_trip(port, f"k{i}") for i in range(3)]  # a valid rank during the attack
    # the slow one keeps trickling a byte a second, so no idle timeout can close it: only the first-frame deadline
    for _ in range(int(WAIT)):
        try:
            slow.sendall(b"\x00")
        except OSError:  # reset: the server closed it
            slow_closed = True
            break
        time.sleep(1.0)
        if _closed(slow, 0.01):
            slow_closed = True
            break
    rss_during = server.memory_info().rss
    assert slow_closed, "a connection trickling bytes outlived the first-frame deadline"
    newest = idle[-50:]  # the last to connect: closed by their deadline, if not evicted before
    assert sum(_closed(s) for s in newest) == 50, "idle connections outlived the first-frame deadline"
    refused = _refusals(proc)
    # every idle connection ended by its deadline or made room for a newer one; none was let in
    assert refused["first_frame_deadline"] + refused["evicted"] >= len(idle) + 1, refused
    assert refused["too_many_connections"] == 0 and refused["first_frame_deadline"] >= 51, refused
    latencies.append(_valid_round_trip(port, "after"))
    growth = rss_during - rss_before
    print(f"store RSS before {rss_before / 2**20:.1f} MiB, during the attack {rss_during / 2**20:.1f} MiB; "
          f"{len(idle)} idle connections; valid rank round trips {[f'{t * 1e3:.1f} ms' for t in latencies]}")
    assert growth < 64 << 20, f"the store grew by {growth / 2**20:.0f} MiB under attack"
    for s in attackers + oversized + idle + [slow]:
        s.close()
