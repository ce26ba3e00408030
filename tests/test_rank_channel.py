"""The rank channel of ``gpucomm-run --mpi`` (``gpucomm/runner/rank_channel.py`` and the rank's
side, ``mpi_rank.py``), attacked the ways issue 36 found: a replayed hello, hundreds of idle
connections, a hello trickled a byte at a time; then its status reports and the rank wrapper's
hold, signal forwarding and end, without an MPI launcher."""

from __future__ import annotations

import io
import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from gpucomm.runner import mpi_rank
from gpucomm.runner.mpi_rank import CHALLENGE_BYTES, hello, open_connection, status_line
from gpucomm.runner.output import OutputSink
from gpucomm.runner.rank_channel import MAX_PENDING, OutputServer
from tests.harness import PYTHON, started

SECRET, RUN = b"s" * 32, "run1"


@pytest.fixture
def channel():
    out = io.StringIO()
    server = OutputServer(OutputSink(3, stdout=out, stderr=io.StringIO()), "127.0.0.1", SECRET, RUN, 3,
                          hello_seconds=1.0)
    yield server, out
    server.close()


def _settle(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(64) == b""
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def test_a_replayed_hello_is_refused(channel):
    """Issue 36: a hello seen once was accepted again, and its lines appeared under the rank's name."""
    server, out = channel
    genuine, nonce = open_connection("127.0.0.1", server.port, SECRET, RUN, 0, "stdout")
    seen = hello(SECRET, nonce, RUN, 0, "stdout")  # what a sniffer saw on the genuine connection
    genuine.sendall(b"from rank 0\n")
    genuine.close()
    replay = socket.create_connection(("127.0.0.1", server.port))
    challenge = replay.recv(CHALLENGE_BYTES)
    assert len(challenge) == CHALLENGE_BYTES and challenge[5:] != nonce  # a fresh challenge
    replay.sendall(seen + b"injected\n")
    assert _closed_by_peer(replay)
    assert _settle(lambda: "from rank 0" in out.getvalue())
    assert "injected" not in out.getvalue() and out.getvalue() == "[0]<stdout>:from rank 0\n"


def test_a_forged_or_second_claim_is_refused(channel):
    server, out = channel
    with pytest.raises(OSError):
        open_connection("127.0.0.1", server.port, b"x" * 32, RUN, 1, "stdout")  # another secret
    with pytest.raises(OSError):
        open_connection("127.0.0.1", server.port, SECRET, "other-run", 1, "stdout")
    with pytest.raises(OSError):
        open_connection("127.0.0.1", server.port, SECRET, RUN, 3, "stdout")  # no rank 3 in a 3-rank job
    first, _ = open_connection("127.0.0.1", server.port, SECRET, RUN, 1, "stderr")
    with pytest.raises(OSError):
        open_connection("127.0.0.1", server.port, SECRET, RUN, 1, "stderr")  # taken: one claim per stream
    first.close()


def test_idle_connections_stay_in_a_bounded_pool_and_never_keep_a_rank_out(channel):
    """Issue 36: 600 idle connections became 600 threads."""
    server, out = channel
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(600)]
    try:
        assert _settle(lambda: server.pending() <= MAX_PENDING and threading.active_count() - before <= MAX_PENDING + 8)
        print(f"600 idle connections: {threading.active_count() - before} threads, {server.pending()} pending")
        conn, _ = open_connection("127.0.0.1", server.port, SECRET, RUN, 2, "stdout")
        conn.sendall(b"still admitted\n")
        conn.close()
        assert _settle(lambda: "[2]<stdout>:still admitted" in out.getvalue())
    finally:
        for c in idle:
            c.close()


def test_a_trickled_hello_is_cut_at_the_whole_hellos_deadline(channel):
    """Issue 36: one byte every 10 s kept a hello open past 50 s (the timeout was per read). Here the
    hello deadline is 1 s and a byte goes every 0.3 s for up to 6 s: the server must close first."""
    server, _ = channel
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.recv(CHALLENGE_BYTES)
    t0 = time.monotonic()
    closed = False
    for byte in b'{"run_id": "' + b"x" * 20:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        if _closed_by_peer(sock, 0.3):
            closed = True
            break
    print(f"trickled hello closed by the server after {time.monotonic() - t0:.1f} s")
    assert closed, "the server kept a trickled hello open past its deadline"


def _status_connection(server: OutputServer, rank: int) -> tuple[socket.socket, bytes]:
    return open_connection("127.0.0.1", server.port, SECRET, RUN, rank, "status")


def test_status_reports_are_macd_and_a_failed_rank_is_held_until_release(channel):
    server, _ = channel
    ok, nonce0 = _status_connection(server, 0)
    ok.sendall(status_line(SECRET, nonce0, 0, None, "h0"))
    failed, nonce1 = _status_connection(server, 1)
    failed.sendall(status_line(SECRET, nonce1, None, signal.SIGKILL, "h1"))
    forged, _ = _status_connection(server, 2)
    forged.sendall(status_line(b"x" * 32, b"n" * 16, 0, None, "h2"))  # a MAC under another key: not a report
    assert _settle(server.ends.all_ended)
    ends = {e.rank: e for e in server.ends.ends()}
    assert (ends[0].code, ends[0].signal, ends[0].failed) == (0, None, False)
    assert (ends[1].code, ends[1].signal, ends[1].host, ends[1].exit_status) == (None, 9, "h1", 137)
    assert not ends[2].reported and "without a report" in ends[2].describe()
    assert server.ends.first_failure().rank == 1
    assert _closed_by_peer(ok)  # a rank that ended well is let go at once
    assert not _closed_by_peer(failed, 0.3)  # a failed one waits for the release
    server.ends.release()
    assert _closed_by_peer(failed)
    for s in (ok, failed, forged):
        s.close()


WRAPPED = {
    "killed": "import os, signal; print('before', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
    "exit3": "import sys; print('oops', file=sys.stderr); sys.exit(3)",
    "sleeps": "import time; print('sleeping', flush=True); time.sleep(60)",
}


def _wrapper_env(server: OutputServer, rank: int) -> dict[str, str]:
    return {"PMI_RANK": str(rank), "GPUCOMM_OUTPUT_ADDR": "127.0.0.1", "GPUCOMM_OUTPUT_PORT": str(server.port),
            "GPUCOMM_SECRET": SECRET.hex(), "GPUCOMM_RUN_ID": RUN}


@pytest.mark.parametrize("case, rank, want", [("killed", 0, (None, signal.SIGKILL, -signal.SIGKILL)),
                                                ("exit3", 1, (3, None, 3))])
def test_the_wrapper_reports_how_its_rank_ended_and_ends_the_same_way(channel, case, rank, want):
    server, out = channel
    cmd = [PYTHON, str(Path(mpi_rank.__file__)), PYTHON, "-c", WRAPPED[case]]
    with started(cmd, env=_wrapper_env(server, rank), timeout=60) as job:
        assert _settle(lambda: rank in {e.rank for e in server.ends.ends()})
        time.sleep(0.3)
        assert job.proc.poll() is None, "a failed rank's wrapper must wait for gpucomm-run's release"
        server.ends.release()
        job.proc.wait(timeout=30)
        end = server.ends.ends()[0]
        assert (end.code, end.signal, job.proc.returncode) == want
    assert job.leftovers == []


def test_the_wrapper_passes_sigterm_to_its_rank(channel):
    server, out = channel
    cmd = [PYTHON, str(Path(mpi_rank.__file__)), PYTHON, "-c", WRAPPED["sleeps"]]
    with started(cmd, env=_wrapper_env(server, 2), timeout=60) as job:
        assert _settle(lambda: "[2]<stdout>:sleeping" in out.getvalue())
        job.proc.send_signal(signal.SIGTERM)
        assert _settle(lambda: server.ends.ends() != [])
        assert server.ends.ends()[0].signal == signal.SIGTERM
        server.ends.release()
        job.proc.wait(timeout=30)
        assert job.proc.returncode == -signal.SIGTERM
    assert job.leftovers == []


def test_the_wrapper_without_gpucomm_runs_variables_runs_the_command_unprefixed():
    with started([PYTHON, str(Path(mpi_rank.__file__)), PYTHON, "-c", "print('plain')"], timeout=60) as job:
        out, err = job.proc.communicate(timeout=30)
    assert job.proc.returncode == 0 and out == "plain\n"
    assert "rank output is not prefixed" in err and "lacks gpucomm-run's variables" in err


def test_hello_lines_name_their_fields():
    line = json.loads(hello(SECRET, b"n" * 16, RUN, 1, "stderr"))
    assert {k: line[k] for k in ("run_id", "rank", "stream")} == {"run_id": RUN, "rank": 1, "stream": "stderr"}
    assert line["mac"] != json.loads(hello(SECRET, b"m" * 16, RUN, 1, "stderr"))["mac"]  # the nonce is in it
