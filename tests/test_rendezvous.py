"""The authenticated bootstrap store: operations, timeouts, and hostile or broken peers."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from gpucomm.bootstrap.rendezvous import (FIRST_FRAME_SECONDS, HELLO_BYTES, RendezvousAuthError, RendezvousClient,
                                          RendezvousError, RendezvousServer, RendezvousTimeout, barrier, wait_for_ranks)
from tests.harness import free_port

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def server():
    with RendezvousServer(SECRET, "127.0.0.1", 0) as s:
        yield s


def client_for(server, secret=SECRET, **kw) -> RendezvousClient:
    return RendezvousClient("127.0.0.1", server.port, secret, **kw)


def test_set_get_add_check_delete_num_keys(server):
    c = client_for(server)
    c.set("a", b"\x00\x01binary")
    assert c.get("a") == b"\x00\x01binary"
    assert c.add("n", 5) == 5 and c.add("n", -2) == 3
    assert c.check(["a", "n"]) and not c.check(["a", "missing"])
    assert c.num_keys() == 2
    assert c.delete("a") and not c.delete("a")
    assert c.compare_set("cas", b"", b"first") == b"first"
    assert c.compare_set("cas", b"wrong", b"second") == b"first"
    c.close()


def test_get_blocks_until_another_client_sets(server):
    a, b = client_for(server), client_for(server)
    later = threading.Timer(0.2, lambda: b.set("late", b"v"))
    later.start()
    assert a.get("late", timeout=5) == b"v"  # only b's later set makes the key: the get waited for it
    later.join(5)  # b's set has its reply before the fixture closes the store (else: a warning from its thread)


def test_concurrent_blocking_get_does_not_block_set_on_same_client(server):
    c = client_for(server)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("v", c.get("k", timeout=5)))
    t.start()
    time.sleep(0.1)
    c.set("k", b"x")  # must not wait behind the blocked get
    t.join(5)
    assert result["v"] == b"x"


def test_wait_timeout_names_missing_ranks(server):
    c = client_for(server)
    c.set("arrive/0", b"1")
    c.set("arrive/2", b"1")
    with pytest.raises(RendezvousTimeout, match=r"ranks \[1, 3\] never arrived") as info:
        wait_for_ranks(c, "arrive", range(4), 0.3, "the test")
    assert sorted(info.value.missing) == ["arrive/1", "arrive/3"]
    with pytest.raises(RendezvousTimeout):
        c.get("never", timeout=0.2)


def test_barrier_of_three_threads(server):
    errors = []

    def member(rank):
        try:
            barrier(client_for(server), "b", rank, 3, 5)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors


def test_wrong_secret_is_rejected_and_honest_clients_keep_working(server, caplog):
    honest = client_for(server)
    with pytest.raises(RendezvousAuthError, match="job secret"):  # at connect: its first frame is checked
        client_for(server, secret=b"not-the-job-secret-at-all-000000")
    assert not honest.check(["x"])
    honest.set("ok", b"1")
    assert honest.get("ok") == b"1"
    assert any("MAC does not match" in r.message for r in caplog.records)


def _raw(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert len(s.recv(HELLO_BYTES, socket.MSG_WAITALL)) == HELLO_BYTES
    return s


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(16) in (b"", b"\x00\x00\x00\x00DENY")
    except ConnectionResetError:  # closed with our unread bytes still queued: a reset
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize("payload, cause", [
    (struct.pack(">I", 0xFFFFFFFF), "bad_frame"),                # absurd length prefix: no 4 GiB allocation
    (struct.pack(">I", 5) + b"abcde", "bad_frame"),              # shorter than a MAC
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_frame"),        # garbage (an HTTP client)
    (struct.pack(">I", 64) + b"\x01" * 64, "bad_mac"),           # right size, forged MAC
])
def test_hostile_frames_close_connection_and_store_keeps_serving(server, payload, cause):
    honest = client_for(server)
    s = _raw(server)
    s.settimeout(FIRST_FRAME_SECONDS + 30)  # a wait's limit: the cause below tells refusal from the deadline
    s.sendall(payload)
    assert _closed_by_server(s)
    counts = server.refusal_counts()
    assert counts[cause] == 1 and sum(counts.values()) == 1, counts  # refused for what it sent, not for its silence
    s.close()
    honest.set("still", b"here")
    assert honest.get("still") == b"here"


def test_truncated_frame_then_disconnect(server):
    honest = client_for(server)
    s = _raw(server)
    s.sendall(struct.pack(">I", 100) + b"x" * 10)
    s.close()
    time.sleep(0.1)
    honest.set("k", b"v")
    assert honest.get("k") == b"v"


def test_replayed_frame_is_rejected(server):
    """A frame captured on one connection is useless on another (per-connection nonce)."""
    from gpucomm.bootstrap.framing import MAC_BYTES, encode_fields, mac as _mac
    from gpucomm.bootstrap.rendezvous import OP_SET

    c = client_for(server)
    chan = c._acquire()
    body = encode_fields(OP_SET, [b"replay", b"1"])
    frame = struct.pack(">I", MAC_BYTES + len(body)) + _mac(SECRET, chan.nonce, b"C", chan.send_seq, body) + body
    chan.sock.sendall(frame)  # exactly what chan.send would put on the wire
    chan.send_seq += 1
    chan.recv(None)
    assert c.check(["replay"])
    c.delete("replay")
    s = _raw(server)
    s.sendall(frame)
    assert _closed_by_server(s)
    assert not c.check(["replay"])


def test_connect_retries_until_server_appears():
    """Nothing listens yet: the client's attempts are refused and it tries again; the server starts only
    once the client has counted two such retries (so they are not a matter of timing), and the client
    then connects and works."""
    port = free_port()  # below the ephemeral range: a retried connect cannot meet another socket's port
    clients: list[RendezvousClient] = []
    outcome: dict = {}

    class Published(RendezvousClient):
        """Hands its instance out before connecting, so the test can read its retry counter meanwhile."""

        def __init__(self, *args, **kwargs):
            clients.append(self)
            super().__init__(*args, **kwargs)

    def connect() -> None:
        try:
            outcome["client"] = Published("127.0.0.1", port, SECRET, connect_timeout=60)
        except Exception as e:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = e

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard, never a measure
    while thread.is_alive() and not (clients and clients[0].connect_retries >= 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    # refused twice and still retrying (not failed): only now does the store start
    assert thread.is_alive() and clients[0].connect_retries >= 2, outcome
    with RendezvousServer(SECRET, "127.0.0.1", port) as server:
        thread.join(60)
        assert "error" not in outcome, outcome["error"]
        c = outcome["client"]
        c.set("a", b"b")
        assert c.get("a") == b"b"
        assert server.connection_counts() == {"authenticated": 1, "pending": 0}  # one connection, made once
        c.close()


def test_connect_timeout_explains_causes():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RendezvousError, match="could not reach the gpucomm rendezvous store"):
        RendezvousClient("127.0.0.1", port, SECRET, connect_timeout=0.5)


def test_client_sees_server_shutdown_as_error(server):
    c = client_for(server)
    c.set("a", b"1")
    server.close()
    with pytest.raises(RendezvousError):
        c.get("a")
