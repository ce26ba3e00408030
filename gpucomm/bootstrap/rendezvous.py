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

Authenticated peers are bounded too (``GPUCOMM_STORE_MAX_BYTES``, default 128 MiB): the values
ranks write may total at most that many bytes (key lengths included; values the hosting process
``put`` itself are not counted), and frames larger than ``SMALL_FRAME`` reserve their length from
a budget of the same size before their body is read, waiting up to ``FRAME_SECONDS`` for room. A
frame that cannot be taken (over the per-frame limit, no room in flight, over the cap) is read and
dropped without being kept, and answered ``REFUSED`` with the reason, which the client raises as
``RendezvousRefused``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from ..settings import DEFAULT_LIVENESS_S, STORE_MAX_BYTES
from .keepalive import bound_dead_peer
from .framing import (DENY, HELLO_BYTES, MAC_BYTES, MAGIC, NONCE_BYTES, VERSION, FrameError, FramedChannel,
                      decode_fields, encode_fields, recv_exact)
from ..errors import RendezvousError, RendezvousAuthError, RendezvousRefused, RendezvousTimeout, RendezvousUnreachable

log = logging.getLogger("gpucomm.rendezvous")

DEFAULT_MAX_FRAME = 64 << 20  # the NCCL id is 128 B and Gloo's addresses ~100 B; 64 MiB is generous
PREAUTH_MAX_FRAME = 4096  # the largest frame read from a peer that has not authenticated yet
FIRST_FRAME_SECONDS = 5.0  # connect -> first authenticated frame
FRAME_SECONDS = 30.0  # first byte -> last byte of any later frame
MAX_PENDING = 512  # connections not yet authenticated; beyond it the oldest is closed
MAX_CONNECTIONS = 4096  # authenticated connections
MAX_BYTES_VAR = STORE_MAX_BYTES.names[0]
DEFAULT_MAX_BYTES = 128 << 20  # values written by ranks, and (separately) frames being received
SMALL_FRAME = 64 << 10  # frames up to this size need no reservation (NCCL ids, addresses, arrival records)

_I64 = struct.Struct(">q")

OP_SET, OP_GET, OP_ADD, OP_WAIT, OP_CHECK, OP_DELETE, OP_NUM_KEYS, OP_COMPARE_SET, OP_PING = range(1, 10)
ST_OK, ST_TIMEOUT, ST_ERROR, ST_REFUSED = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# server


class _Table:
    """The key-value data with blocking waits, and the bytes ranks have stored (capped)."""

    def __init__(self, max_bytes: int) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.max_bytes = max_bytes
        self.sizes: dict[str, int] = {}  # keys written by clients -> bytes counted against the cap
        self.counted = 0

    def write(self, key: str, value: bytes) -> str | None:
        """(holding ``cond``) Store a client's value, or return why it was refused (over the cap)."""
        size = len(key) + len(value)
        total = self.counted - self.sizes.get(key, 0) + size
        if total > self.max_bytes and size > self.sizes.get(key, 0):
            return (f"the rendezvous store refused to store {key!r} ({len(value)} bytes): ranks would then hold "
                    f"{total} bytes in it, over its cap of {self.max_bytes} bytes ({MAX_BYTES_VAR}). The "
                    f"bootstrap store is for small values (addresses, ids, gpucomm.run results). Likely causes: "
                    f"a script putting large objects in it, or a runaway or hostile client. Fix: store less, or "
                    f"raise {MAX_BYTES_VAR} where the store runs (rank 0, or the launcher).")
        self.data[key] = value
        self.counted = total
        self.sizes[key] = size
        return None

    def put_local(self, key: str, value: bytes) -> None:
        """(holding ``cond``) Store the hosting process's own value (not counted against the cap)."""
        self.data[key] = value
        self.counted -= self.sizes.pop(key, 0)

    def remove(self, key: str) -> bool:
        """(holding ``cond``) Delete ``key``; True when it existed."""
        self.counted -= self.sizes.pop(key, 0)
        return self.data.pop(key, None) is not None

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


class _Budget:
    """Bytes of frames being received at once: larger frames reserve their length before their
    body is read, and wait (up to a deadline) while others hold the budget."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self.cond = threading.Condition()
        self.closed = False

    def reserve(self, n: int, deadline: float) -> bool:
        with self.cond:
            while self.used + n > self.total:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(left)
            self.used += n
            return True

    def release(self, n: int) -> None:
        if n:
            with self.cond:
                self.used -= n
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def max_store_bytes(env: Mapping[str, str] | None = None) -> int:
    """The store's byte cap: ``GPUCOMM_STORE_MAX_BYTES`` (a whole number of bytes, at least one small
    frame), else 128 MiB."""
    return STORE_MAX_BYTES.read(env, DEFAULT_MAX_BYTES)


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
    """Serves the store on ``host:port`` (port 0 picks a free one) from daemon threads. ``max_bytes``
    caps what ranks may store and what may be in flight at once (default: ``max_store_bytes()``);
    no frame is larger than ``min(max_frame, max_bytes)``. ``host`` is where it listens: pass the
    address the ranks are told (``0.0.0.0`` listens on every interface). ``dead_peer_after``: a
    connection whose peer's host acknowledged nothing for that long is dropped (``keepalive.py``),
    so a rank on a host that fell off the network does not hold a thread here for ~15 minutes."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME,
                 max_bytes: int | None = None, dead_peer_after: float | None = DEFAULT_LIVENESS_S):
        if not secret:
            raise ValueError("RendezvousServer needs a non-empty job secret")
        max_bytes = max_store_bytes() if max_bytes is None else max_bytes
        self._secret, self._max_frame = secret, min(max_frame, max_bytes)
        self._table = _Table(max_bytes)
        self._inflight = _Budget(max_bytes)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()  # authenticated
        self._pending: dict[socket.socket, float] = {}  # not yet authenticated -> accept time (oldest first)
        self._lock = threading.Lock()
        self._rejections = _RateLimitedLog()
        self._dead_peer_after = dead_peer_after
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
        self._inflight.close()
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
            self._table.put_local(key, value)
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
            bound_dead_peer(conn, self._dead_peer_after)
            conn.settimeout(FIRST_FRAME_SECONDS)
            conn.sendall(MAGIC + bytes([VERSION]) + nonce)
            while not self._closed:
                held, refusal = 0, ""
                try:
                    if authenticated:
                        body, held, refusal = self._next_frame(chan)
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
                if refusal:
                    self._rejections.warning("rendezvous: refused a frame from %s: %s", peer, refusal)
                    chan.send(encode_fields(ST_REFUSED, [refusal.encode()]))
                    continue
                try:
                    op, fields = decode_fields(body)
                    status, out = self._dispatch(op, fields)
                except FrameError as e:
                    self._rejections.warning("rendezvous: closing connection from %s: malformed request (%s)", peer, e)
                    return
                finally:
                    body = fields = b""  # nothing of the frame stays referenced while the connection idles
                    self._inflight.release(held)
                if status == ST_REFUSED:
                    self._rejections.warning("rendezvous: refused a request from %s: %s", peer, out[0].decode())
                chan.send(encode_fields(status, out))
        except OSError as e:  # socket.timeout included
            if not self._closed and authenticated:
                self._rejections.warning("rendezvous: connection from %s failed: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
            conn.close()

    def _next_frame(self, chan: FramedChannel) -> tuple[bytes, int, str]:
        """An authenticated peer's next frame: (body, bytes reserved for it, "") or, for a frame the
        store will not take, (b"", 0, why): its body was read and dropped, never held."""
        length = chan.recv_header(None)  # idle between requests is fine
        size = length - MAC_BYTES
        if size > self._max_frame:
            chan.skip_body(length, time.monotonic() + FRAME_SECONDS)
            return b"", 0, (f"the rendezvous store refused a frame of {size} bytes: it takes at most {self._max_frame} "
                            f"bytes per frame (the smaller of {DEFAULT_MAX_FRAME >> 20} MiB and {MAX_BYTES_VAR}="
                            f"{self._table.max_bytes}). The bootstrap store carries small values; likely cause: a "
                            f"value that belongs in a collective (hvd.broadcast_object) or a file. Fix: send less, "
                            f"or raise {MAX_BYTES_VAR} where the store runs.")
        held = size if size > SMALL_FRAME else 0
        if held and not self._inflight.reserve(held, time.monotonic() + FRAME_SECONDS):
            chan.skip_body(length, time.monotonic() + FRAME_SECONDS)
            return b"", 0, (f"the rendezvous store refused a frame of {size} bytes: other frames held its whole "
                            f"budget for frames in flight ({self._inflight.total} bytes, {MAX_BYTES_VAR}) for "
                            f"{FRAME_SECONDS:.0f} s. Likely causes: many large values sent at once, or clients that "
                            f"started frames and stalled. Fix: send large values one at a time, or raise "
                            f"{MAX_BYTES_VAR} where the store runs.")
        try:
            return chan.recv_body(length, time.monotonic() + FRAME_SECONDS), held, ""
        except BaseException:
            self._inflight.release(held)
            raise

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
                    refused = t.write(f[0].decode(), f[1])
                    if refused:
                        return ST_REFUSED, [refused.encode()]
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
                    refused = t.write(key, str(value).encode())
                    if refused:
                        return ST_REFUSED, [refused.encode()]
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
                    found = t.remove(f[0].decode())
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
                        refused = t.write(key, f[2])
                        if refused:
                            return ST_REFUSED, [refused.encode()]
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
    blocking ``get`` on one thread never holds up a ``set`` on another. ``dead_peer_after``: a
    request to a store whose host stopped acknowledging (a cut link, a host that is gone) fails
    after about that long (``keepalive.py``), never after TCP's ~15 minutes or, idle, never."""

    def __init__(self, host: str, port: int, secret: bytes, *, connect_timeout: float = 60.0,
                 timeout: float = 300.0, max_frame: int = DEFAULT_MAX_FRAME,
                 dead_peer_after: float | None = DEFAULT_LIVENESS_S):
        if not secret:
            raise ValueError("RendezvousClient needs a non-empty job secret")
        self.host, self.port = host, port
        self.timeout = timeout
        self._secret, self._max_frame = secret, max_frame
        self._connect_timeout = connect_timeout
        self._dead_peer_after = dead_peer_after
        self._idle: list[FramedChannel] = []
        self._busy: set[FramedChannel] = set()  # channels with a request in flight (close() interrupts them)
        self._lock = threading.Lock()
        self._closed = False
        self._gone: str | None = None  # why the store is known to be gone (every call then fails at once)
        self._connected_once = False  # then a refused reconnection means the store's process is gone
        self.connect_retries = 0  # failed connection attempts that were tried again (store not up or answering)
        self._release(self._connect())  # fail fast, with the retry loop, at construction
        self._connected_once = True

    # -- connections --------------------------------------------------------------------------
    def _connect(self) -> FramedChannel:
        deadline = time.monotonic() + self._connect_timeout
        delay, last_error = 0.01, None
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                bound_dead_peer(sock, self._dead_peer_after)
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
            except ConnectionRefusedError as e:
                if self._connected_once:  # it was up, and nothing listens there now: it is gone
                    raise RendezvousError(
                        f"the gpucomm rendezvous store at {self.host}:{self.port} stopped listening ({e}): the "
                        f"process serving it (rank 0, or the launcher) has exited or failed. Its own output says "
                        f"why.") from None
                last_error = e
            except OSError as e:
                last_error = e
            if time.monotonic() + delay > deadline:
                raise RendezvousUnreachable(
                    f"could not reach the gpucomm rendezvous store at {self.host}:{self.port} within "
                    f"{self._connect_timeout:.0f} s (last error: {last_error}). Rank 0 (or the launcher) serves it. "
                    f"Likely causes: rank 0 has not started, failed at start (for example on a setting it refused) "
                    f"or has died, and its own output says why; the address is not reachable from this "
                    f"host (firewall, wrong interface); ranks disagree on GPUCOMM_RENDEZVOUS_ADDR/PORT. "
                    f"Raise the limit with GPUCOMM_START_TIMEOUT if rank 0 starts slowly.")
            with self._lock:
                self.connect_retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _acquire(self) -> FramedChannel:
        with self._lock:
            if self._gone is not None:
                raise RendezvousError(f"the rendezvous store at {self.host}:{self.port} is gone: {self._gone}")
            if self._closed:
                raise RendezvousError("the rendezvous client is closed (gpucomm was shut down)")
            chan = self._idle.pop() if self._idle else None
        if chan is None:
            chan = self._connect()
        with self._lock:
            self._busy.add(chan)
            if self._closed:
                _shut(chan.sock)
        return chan

    def _release(self, chan: FramedChannel, *, broken: bool = False) -> None:
        with self._lock:
            self._busy.discard(chan)
            if not self._closed and not broken:
                self._idle.append(chan)
                return
        chan.sock.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    @property
    def secret(self) -> bytes:
        """The job secret this client authenticates with (the control plane reuses it)."""
        return self._secret

    def abandon(self, why: str) -> None:
        """The store is known to be gone (its host died): every call, now and later, fails at once
        with ``why`` instead of retrying for the start timeout (a failed job's shutdown must not
        wait two minutes for a store that will not come back)."""
        with self._lock:
            if self._gone is None:
                self._gone = why
        self.close()

    @property
    def gone(self) -> str | None:
        """Why the store is known to be gone, if it is."""
        return self._gone

    def close(self) -> None:
        """Close every connection; requests still in flight on other threads end with an error."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for c in idle:
            c.sock.close()
        for c in busy:
            _shut(c.sock)

    def _request(self, op: int, fields: Sequence[bytes], within: float | None = None) -> tuple[int, list[bytes]]:
        """Send one request and read its answer; ``within``: the answer must arrive in that many
        seconds (else ``RendezvousError``), for calls that must not wait on a store that may be gone."""
        body = encode_fields(op, fields)
        if len(body) > self._max_frame:
            raise RendezvousRefused(
                f"refused before sending: a request of {len(body)} bytes is over the rendezvous store's limit of "
                f"{self._max_frame} bytes per frame. The bootstrap store carries small values (addresses, ids); "
                f"send large data with a collective (hvd.broadcast_object) or through a file instead.")
        chan = self._acquire()
        try:
            chan.send(body)
            status, out = decode_fields(chan.recv(None, deadline=None if within is None else time.monotonic() + within))
        except FrameError as e:
            self._release(chan, broken=True)
            if str(e) == "DENY":
                raise RendezvousAuthError(
                    f"the rendezvous store at {self.host}:{self.port} rejected this process's frames: its job secret "
                    f"differs from ours. Every rank of one job must share GPUCOMM_SECRET (gpucomm-run sets it); a "
                    f"process from another job may be using the same address and port.") from None
            raise RendezvousError(f"rendezvous store at {self.host}:{self.port} broke the connection: {e}. "
                                  f"{self._lost_why()}") from None
        except OSError as e:
            self._release(chan, broken=True)
            raise RendezvousError(f"rendezvous store at {self.host}:{self.port} failed: {e}. "
                                  f"{self._lost_why(e)}") from None
        self._release(chan)
        if status == ST_REFUSED:
            raise RendezvousRefused(out[0].decode(errors="replace") if out else "the store refused the request")
        if status == ST_ERROR:
            raise RendezvousError(out[0].decode(errors="replace") if out else "store error")
        return status, out

    def _lost_why(self, error: OSError | None = None) -> str:
        if self._closed:
            return "This client was closed meanwhile (gpucomm was shut down)."
        if error is not None and error.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH):
            limit = f"{self._dead_peer_after:g} s" if self._dead_peer_after else "TCP's retransmission limit"
            return (f"The store's host {self.host} stopped answering (nothing acknowledged for {limit}): its link is "
                    f"cut or the host is gone, and with it the launcher or rank 0 that serves the store.")
        return ("Rank 0 (or the launcher), which serves the store, has probably exited or failed (a frame the "
                "store will not take is answered with the reason, not a closed connection).")

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

    def add(self, key: str, delta: int, *, within: float | None = None) -> int:
        """Add ``delta`` to the counter ``key`` and return its new value (``within``: see ``_request``)."""
        return _I64.unpack(self._request(OP_ADD, [key.encode(), _I64.pack(delta)], within)[1][0])[0]

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
