"""The bootstrap key-value store: a small TCP server inside rank 0 (or the launcher) and a client in
every rank.

Why our own store: every frame is authenticated with HMAC-SHA256 under the job secret (torch's
TCPStore and Horovod's HTTP store are not), reads are framed and bounded (a hostile or broken peer
cannot make the server allocate gigabytes or hang the honest ranks), and a timeout says which
ranks never arrived instead of "timed out".

Frames are authenticated and sequenced (``framing.py``). A body is one opcode byte followed by
fields, each ``u32 length | bytes``. A frame that fails any check is logged (rate-limited),
answered with an unauthenticated ``DENY`` marker when the MAC is wrong, and its connection is
closed; the store keeps serving everyone else.

Hostile or broken peers: until a connection's first frame has passed its MAC it may send at most
``PREAUTH_MAX_FRAME`` bytes, and must do so within ``FIRST_FRAME_SECONDS`` of connecting (clients
send a ``PING`` right after the hello); afterwards every frame must be complete within
``FRAME_SECONDS`` of its first byte. Connections that have not authenticated live in a bounded
pool of their own: when it is full the oldest is closed, so thousands of idle or garbage
connections can never keep a valid rank out, and never grow the server beyond the pool.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from .framing import (DENY, HELLO_BYTES, MAGIC, NONCE_BYTES, VERSION, FrameError, FramedChannel, decode_fields,
                      encode_fields, recv_exact)

log = logging.getLogger("gpucomm.rendezvous")

DEFAULT_MAX_FRAME = 64 << 20  # the NCCL id is 128 B and Gloo's addresses ~100 B; 64 MiB is generous
PREAUTH_MAX_FRAME = 4096  # the largest frame read from a peer that has not authenticated yet
FIRST_FRAME_SECONDS = 5.0  # connect -> first authenticated frame
FRAME_SECONDS = 30.0  # first byte -> last byte of any later frame
MAX_PENDING = 512  # connections not yet authenticated; beyond it the oldest is closed
MAX_CONNECTIONS = 4096  # authenticated connections

_I64 = struct.Struct(">q")

OP_SET, OP_GET, OP_ADD, OP_WAIT, OP_CHECK, OP_DELETE, OP_NUM_KEYS, OP_COMPARE_SET, OP_PING = range(1, 10)
ST_OK, ST_TIMEOUT, ST_ERROR = 0, 1, 2


class RendezvousError(RuntimeError):
    """The bootstrap store could not be reached or answered wrongly."""


class RendezvousAuthError(RendezvousError):
    """The server rejected our frames: the job secrets differ."""


class RendezvousTimeout(RendezvousError):
    """A wait ran out; ``missing`` lists the keys that never appeared."""

    def __init__(self, message: str, missing: Sequence[str]) -> None:
        super().__init__(message)
        self.missing = list(missing)


# ---------------------------------------------------------------------------------------------
# server


class _Table:
    """The key-value data with blocking waits."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closed = False

    def wait_for(self, keys: Sequence[str], timeout: float) -> list[str]:
        """Block until every key exists; return the keys still missing at the deadline."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                missing = [k for k in keys if k not in self.data]
                left = deadline - time.monotonic()
                if not missing or left <= 0 or self.closed:
                    return missing
                self.cond.wait(min(left, 1.0))


class _RateLimitedLog:
    """At most ``burst`` warnings per ``window`` seconds; the rest are counted and reported in one
    line when the next window opens (a flood of bad peers must not flood the log)."""

    def __init__(self, burst: int = 5, window: float = 60.0) -> None:
        self.burst, self.window = burst, window
        self._start, self._shown, self._suppressed = 0.0, 0, 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window:
                if self._suppressed:
                    log.warning("rendezvous: %d more rejected or failed connections in the last %.0f s were not "
                                "logged one by one", self._suppressed, self.window)
                self._start, self._shown, self._suppressed = now, 0, 0
            if self._shown >= self.burst:
                self._suppressed += 1
                return
            self._shown += 1
        log.warning(message, *args)


class RendezvousServer:
    """Serves the store on ``host:port`` (port 0 picks a free one) from daemon threads."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME):
        if not secret:
            raise ValueError("RendezvousServer needs a non-empty job secret")
        self._secret, self._max_frame = secret, max_frame
        self._table = _Table()
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()  # authenticated
        self._pending: dict[socket.socket, float] = {}  # not yet authenticated -> accept time (oldest first)
        self._lock = threading.Lock()
        self._rejections = _RateLimitedLog()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="gpucomm-rendezvous", daemon=True)
        self._thread.start()
        log.debug("rendezvous server listening on %s:%d", host, self.port)

    def close(self) -> None:
        """Stop accepting, wake blocked waits, and close every connection."""
        if self._closed:
            return
        self._closed = True
        with self._table.cond:
            self._table.closed = True
            self._table.cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns) + list(self._pending)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(timeout=5)

    def snapshot(self, prefix: str = "") -> dict[str, bytes]:
        """The keys under ``prefix`` and their values, read in this process (for the process
        hosting the store, e.g. the launcher reading what the ranks reported)."""
        with self._table.cond:
            return {k: v for k, v in self._table.data.items() if k.startswith(prefix)}

    def put(self, key: str, value: bytes) -> None:
        """Set ``key`` from this process (the launcher publishing to its ranks), waking waiters."""
        with self._table.cond:
            self._table.data[key] = value
            self._table.cond.notify_all()

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connection_counts(self) -> dict[str, int]:
        """Open connections: ``authenticated`` and ``pending`` (not yet authenticated)."""
        with self._lock:
            return {"authenticated": len(self._conns), "pending": len(self._pending)}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                evicted = None
                if len(self._pending) >= MAX_PENDING:  # out of the pool now, so the next accept picks another
                    evicted = next(iter(self._pending))
                    del self._pending[evicted]
                self._pending[conn] = time.monotonic()
            if evicted is not None:  # the oldest unauthenticated connection makes room; its thread then ends
                self._rejections.warning("rendezvous: %d connections have not authenticated; closing the oldest "
                                         "to admit %s", MAX_PENDING, peer)
                _shut(evicted)
            threading.Thread(target=self._serve, args=(conn, peer), name="gpucomm-rendezvous-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        nonce = os.urandom(NONCE_BYTES)
        chan = FramedChannel(conn, self._secret, nonce, b"S", self._max_frame)
        first_deadline = time.monotonic() + FIRST_FRAME_SECONDS
        authenticated = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(FIRST_FRAME_SECONDS)
            conn.sendall(MAGIC + bytes([VERSION]) + nonce)
            while not self._closed:
                try:
                    if authenticated:
                        body = chan.recv(FRAME_SECONDS)
                    else:
                        body = chan.recv(None, limit=PREAUTH_MAX_FRAME, deadline=first_deadline)
                except FrameError as e:
                    if str(e) == "bad MAC":
                        self._rejections.warning(
                            "rendezvous: rejected a frame from %s: its MAC does not match the job secret (a process "
                            "of another job, or a wrong GPUCOMM_SECRET); closing it", peer)
                        conn.sendall(DENY)
                    elif not str(e).startswith("connection closed after 0 of"):
                        self._rejections.warning("rendezvous: closing connection from %s: %s", peer, e)
                    return
                if not authenticated:
                    authenticated = True
                    if not self._admit(conn, peer):
                        chan.send(encode_fields(ST_ERROR, [b"the rendezvous store has too many connections open"]))
                        return
                try:
                    op, fields = decode_fields(body)
                    status, out = self._dispatch(op, fields)
                except FrameError as e:
                    self._rejections.warning("rendezvous: closing connection from %s: malformed request (%s)", peer, e)
                    return
                chan.send(encode_fields(status, out))
        except OSError as e:  # socket.timeout included
            if not self._closed and authenticated:
                self._rejections.warning("rendezvous: connection from %s failed: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
            conn.close()

    def _admit(self, conn: socket.socket, peer: object) -> bool:
        """Move an authenticated connection out of the pending pool (False: too many open)."""
        with self._lock:
            if self._pending.pop(conn, None) is None:
                return False  # evicted meanwhile (its socket is being shut): it must reconnect
            if len(self._conns) >= MAX_CONNECTIONS:
                full = True
            else:
                self._conns.add(conn)
                full = False
        if full:
            log.warning("rendezvous: refusing %s: %d authenticated connections are open", peer, MAX_CONNECTIONS)
            return False
        conn.settimeout(None)  # idle between requests is fine once authenticated; frames have their deadline
        return True

    def _dispatch(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        t = self._table
        try:
            if op == OP_SET and len(f) == 2:
                with t.cond:
                    t.data[f[0].decode()] = f[1]
                    t.cond.notify_all()
                return ST_OK, []
            if op == OP_GET and len(f) == 2:
                key = f[0].decode()
                if t.wait_for([key], _I64.unpack(f[1])[0] / 1000):
                    return ST_TIMEOUT, [f[0]]
                with t.cond:
                    return ST_OK, [t.data[key]]
            if op == OP_ADD and len(f) == 2:
                key, delta = f[0].decode(), _I64.unpack(f[1])[0]
                with t.cond:
                    value = int(t.data.get(key, b"0")) + delta
                    t.data[key] = str(value).encode()
                    t.cond.notify_all()
                return ST_OK, [_I64.pack(value)]
            if op == OP_WAIT and len(f) >= 1:
                keys = [k.decode() for k in f[1:]]
                missing = t.wait_for(keys, _I64.unpack(f[0])[0] / 1000)
                return (ST_TIMEOUT if missing else ST_OK), [k.encode() for k in missing]
            if op == OP_CHECK:
                with t.cond:
                    return ST_OK, [b"1" if all(k.decode() in t.data for k in f) else b"0"]
            if op == OP_DELETE and len(f) == 1:
                with t.cond:
                    found = t.data.pop(f[0].decode(), None) is not None
                return ST_OK, [b"1" if found else b"0"]
            if op == OP_NUM_KEYS and not f:
                with t.cond:
                    return ST_OK, [_I64.pack(len(t.data))]
            if op == OP_PING and not f:
                return ST_OK, []
            if op == OP_COMPARE_SET and len(f) == 3:
                key = f[0].decode()
                with t.cond:
                    current = t.data.get(key)
                    if (current is None and f[1] == b"") or current == f[1]:
                        t.data[key] = f[2]
                        t.cond.notify_all()
                        return ST_OK, [f[2]]
                    return ST_OK, [current if current is not None else f[1]]
        except (UnicodeDecodeError, ValueError, struct.error) as e:
            raise FrameError(f"bad fields for op {op}: {e}") from e
        raise FrameError(f"unknown op {op} with {len(f)} fields")


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# client


class RendezvousClient:
    """Talks to the store. Thread-safe: concurrent requests use separate pooled connections, so a
    blocking ``get`` on one thread never holds up a ``set`` on another."""

    def __init__(self, host: str, port: int, secret: bytes, *, connect_timeout: float = 60.0,
                 timeout: float = 300.0, max_frame: int = DEFAULT_MAX_FRAME):
        if not secret:
            raise ValueError("RendezvousClient needs a non-empty job secret")
        self.host, self.port = host, port
        self.timeout = timeout
        self._secret, self._max_frame = secret, max_frame
        self._connect_timeout = connect_timeout
        self._idle: list[FramedChannel] = []
        self._lock = threading.Lock()
        self._closed = False
        self._release(self._connect())  # fail fast, with the retry loop, at construction

    # -- connections --------------------------------------------------------------------------
    def _connect(self) -> FramedChannel:
        deadline = time.monotonic() + self._connect_timeout
        delay, last_error = 0.01, None
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = recv_exact(sock, HELLO_BYTES)
                if hello[:4] != MAGIC or hello[4] != VERSION:
                    sock.close()
                    raise RendezvousError(
                        f"{self.host}:{self.port} is not a gpucomm rendezvous store (version {VERSION}): it answered "
                        f"{hello[:5]!r}. Another service holds that port; choose another GPUCOMM_RENDEZVOUS_PORT.")
                chan = FramedChannel(sock, self._secret, hello[5:], b"C", self._max_frame)
                chan.send(encode_fields(OP_PING, []))  # authenticate now: the store closes silent connections
                status, _ = decode_fields(chan.recv(None))
                sock.settimeout(None)
                if status != ST_OK:
                    sock.close()
                    raise OSError("the store refused the connection (too many connections open)")
                return chan
            except FrameError as e:
                if str(e) == "DENY":
                    sock.close()
                    raise RendezvousAuthError(
                        f"the rendezvous store at {self.host}:{self.port} rejected this process's frames: its job "
                        f"secret differs from ours. Every rank of one job must share GPUCOMM_SECRET (gpucomm-run sets "
                        f"it); a process from another job may be using the same address and port.") from None
                last_error = e
            except OSError as e:
                last_error = e
            if time.monotonic() + delay > deadline:
                raise RendezvousError(
                    f"could not reach the gpucomm rendezvous store at {self.host}:{self.port} within "
                    f"{self._connect_timeout:.0f} s (last error: {last_error}). Rank 0 (or the launcher) serves it. "
                    f"Likely causes: rank 0 has not started or has died; the address is not reachable from this "
                    f"host (firewall, wrong interface); ranks disagree on GPUCOMM_RENDEZVOUS_ADDR/PORT. "
                    f"Raise the limit with GPUCOMM_START_TIMEOUT if rank 0 starts slowly.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _acquire(self) -> FramedChannel:
        with self._lock:
            if self._closed:
                raise RendezvousError("the rendezvous client is closed (gpucomm was shut down)")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _release(self, chan: FramedChannel) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(chan)
                return
        chan.sock.close()

    @property
    def secret(self) -> bytes:
        """The job secret this client authenticates with (the control plane reuses it)."""
        return self._secret

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()

    def _request(self, op: int, fields: Sequence[bytes]) -> tuple[int, list[bytes]]:
        chan = self._acquire()
        try:
            chan.send(encode_fields(op, fields))
            status, out = decode_fields(chan.recv(None))
        except FrameError as e:
            chan.sock.close()
            if str(e) == "DENY":
                raise RendezvousAuthError(
                    f"the rendezvous store at {self.host}:{self.port} rejected this process's frames: its job secret "
                    f"differs from ours. Every rank of one job must share GPUCOMM_SECRET (gpucomm-run sets it); a "
                    f"process from another job may be using the same address and port.") from None
            raise RendezvousError(f"rendezvous store at {self.host}:{self.port} broke the connection: {e}. "
                                  f"Rank 0 (which serves the store) has probably exited or failed.") from None
        except OSError as e:
            chan.sock.close()
            raise RendezvousError(f"rendezvous store at {self.host}:{self.port} failed: {e}. Rank 0 (which "
                                  f"serves the store) has probably exited or failed.") from None
        self._release(chan)
        if status == ST_ERROR:
            raise RendezvousError(out[0].decode(errors="replace") if out else "store error")
        return status, out

    # -- operations ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._request(OP_SET, [key.encode(), bytes(value)])

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The key's value, waiting for it to be set (up to ``timeout`` seconds)."""
        t = self.timeout if timeout is None else timeout
        status, out = self._request(OP_GET, [key.encode(), _I64.pack(int(t * 1000))])
        if status == ST_TIMEOUT:
            raise RendezvousTimeout(f"key {key!r} was not set within {t:.1f} s", [key])
        return out[0]

    def add(self, key: str, delta: int) -> int:
        return _I64.unpack(self._request(OP_ADD, [key.encode(), _I64.pack(delta)])[1][0])[0]

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key exists; ``RendezvousTimeout.missing`` lists the absent ones."""
        t = self.timeout if timeout is None else timeout
        status, out = self._request(OP_WAIT, [_I64.pack(int(t * 1000))] + [k.encode() for k in keys])
        if status == ST_TIMEOUT:
            missing = [k.decode() for k in out]
            raise RendezvousTimeout(f"{len(missing)} of {len(keys)} keys were not set within {t:.1f} s: "
                                    f"{', '.join(missing[:10])}", missing)

    def check(self, keys: Sequence[str]) -> bool:
        return self._request(OP_CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def delete(self, key: str) -> bool:
        return self._request(OP_DELETE, [key.encode()])[1][0] == b"1"

    def num_keys(self) -> int:
        return _I64.unpack(self._request(OP_NUM_KEYS, [])[1][0])[0]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._request(OP_COMPARE_SET, [key.encode(), bytes(expected), bytes(desired)])[1][0]


def wait_for_ranks(client: RendezvousClient, prefix: str, ranks: Iterable[int], timeout: float, what: str,
                   interrupt: Callable[[], None] | None = None) -> None:
    """Wait for ``{prefix}/{rank}`` of every rank; a timeout names the ranks that never arrived.
    ``interrupt``, if given, is asked every 0.5 s and may raise to stop the wait."""
    keys = {f"{prefix}/{r}": r for r in ranks}
    deadline = time.monotonic() + timeout
    try:
        while interrupt is not None:
            interrupt()
            left = deadline - time.monotonic()
            try:
                client.wait(list(keys), max(0.0, min(0.5, left)))
                return
            except RendezvousTimeout:
                if left <= 0.5:
                    raise
        client.wait(list(keys), timeout)
    except RendezvousTimeout as e:
        missing = sorted(keys[k] for k in e.missing if k in keys)
        raise RendezvousTimeout(
            f"ranks {missing} never arrived at {what} within {timeout:.0f} s. Likely causes: those processes "
            f"were not started, crashed before reaching this point, or cannot reach the rendezvous store at "
            f"{client.host}:{client.port}; or the job size is wrong. Check their logs (gpucomm-run prefixes "
            f"each line with its rank) and raise GPUCOMM_START_TIMEOUT if they only start slowly.",
            e.missing) from None


def barrier(client: RendezvousClient, name: str, rank: int, size: int, timeout: float) -> None:
    """All ``size`` ranks meet at ``name``; a timeout names the absent ranks."""
    client.set(f"{name}/{rank}", b"1")
    wait_for_ranks(client, name, range(size), timeout, f"'{name}'")
