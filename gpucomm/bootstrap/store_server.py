"""The bootstrap key-value store's server: a small TCP server inside rank 0 (or the launcher); its
client is ``rendezvous.py``, its protocol ``store_protocol.py``.

A frame that fails any check is logged (rate-limited), answered with an unauthenticated ``DENY``
marker when the MAC is wrong, and its connection is closed; the store keeps serving everyone else.

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

import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from ..settings import DEFAULT_LIVENESS_S, STORE_MAX_BYTES
from .keepalive import bound_dead_peer
from .netaddr import listening_socket
from .framing import (DENY, MAC_BYTES, MAGIC, NONCE_BYTES, VERSION, FrameError, FramedChannel, decode_fields,
                      encode_fields)
from ..errors import RendezvousRefused
from .store_protocol import (DEFAULT_MAX_BYTES, DEFAULT_MAX_FRAME, FIRST_FRAME_SECONDS, FRAME_SECONDS, I64,
                             MAX_BYTES_VAR, MAX_CONNECTIONS, MAX_PENDING, OP_ADD, OP_CHECK, OP_COMPARE_SET, OP_DELETE,
                             OP_GET, OP_NUM_KEYS, OP_PING, OP_SET, OP_WAIT, PREAUTH_MAX_FRAME, SMALL_FRAME, ST_ERROR,
                             ST_OK, ST_REFUSED, ST_TIMEOUT, shut)

log = logging.getLogger("gpucomm.rendezvous")

# why the store closed or answered a connection short of serving it (RendezvousServer.refusal_counts)
REFUSAL_CAUSES = (
    "bad_mac",               # a frame signed with another secret (answered DENY)
    "bad_frame",             # before authentication: a length outside the pre-auth limit, or a malformed frame
    "first_frame_deadline",  # no complete authenticated frame within FIRST_FRAME_SECONDS of connecting
    "frame_deadline",        # an authenticated peer's frame not complete within FRAME_SECONDS of its first byte
    "evicted",               # the oldest unauthenticated connection, closed to admit a newer one
    "too_many_connections",  # authenticated while MAX_CONNECTIONS were open
    "refused_frame",         # an authenticated frame over the per-frame limit or the in-flight budget (REFUSED)
    "refused_request",       # a request over the store's byte cap (REFUSED)
    "malformed_request",     # an authenticated frame whose fields do not decode
)


def frame_error_cause(error: FrameError, authenticated: bool) -> str | None:
    """The ``REFUSAL_CAUSES`` entry for a frame error, or None for a peer that simply hung up."""
    if error.kind == "mac":
        return "bad_mac"
    if error.kind == "deadline":
        return "frame_deadline" if authenticated else "first_frame_deadline"
    if error.kind == "closed":
        return None
    return "malformed_request" if authenticated else "bad_frame"


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
    address the ranks are told (``::`` listens on every interface, ``0.0.0.0`` on every IPv4 one). ``dead_peer_after``: a
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
        self._sock = listening_socket(host, port, backlog=1024)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()  # authenticated
        self._pending: dict[socket.socket, float] = {}  # not yet authenticated -> accept time (oldest first)
        self._lock = threading.Lock()
        self._rejections = _RateLimitedLog()
        self._refusals: Counter[str] = Counter()  # cause -> connections or frames refused (under _lock)
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

    def remove(self, key: str) -> bool:
        """Delete ``key`` from this process (the launcher withdrawing what a worker that has ended
        reported); True when it existed."""
        with self._table.cond:
            return self._table.remove(key)

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connection_counts(self) -> dict[str, int]:
        """Open connections: ``authenticated`` and ``pending`` (not yet authenticated)."""
        with self._lock:
            return {"authenticated": len(self._conns), "pending": len(self._pending)}

    def refusal_counts(self) -> dict[str, int]:
        """How many connections or frames the store refused, by cause (``REFUSAL_CAUSES``, every one
        present): what an operator reads to tell an attack or a misconfigured rank from a slow network,
        since the log of each is rate-limited. A cause is counted before its connection is closed."""
        with self._lock:
            return {cause: self._refusals[cause] for cause in REFUSAL_CAUSES}

    def _refused(self, cause: str) -> None:
        with self._lock:
            self._refusals[cause] += 1

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
                    self._refusals["evicted"] += 1
                self._pending[conn] = time.monotonic()
            if evicted is not None:  # the oldest unauthenticated connection makes room; its thread then ends
                self._rejections.warning("rendezvous: %d connections have not authenticated; closing the oldest "
                                         "to admit %s", MAX_PENDING, peer)
                shut(evicted)
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
                    cause = frame_error_cause(e, authenticated)
                    if cause is not None:
                        self._refused(cause)
                    if e.kind == "mac":
                        self._rejections.warning(
                            "rendezvous: rejected a frame from %s: its MAC does not match the job secret (a process "
                            "of another job, or a wrong GPUCOMM_SECRET); closing it", peer)
                        conn.sendall(DENY)
                    elif not (e.kind == "closed" and e.got == 0):
                        self._rejections.warning("rendezvous: closing connection from %s: %s", peer, e)
                    return
                if not authenticated:
                    authenticated = True
                    if not self._admit(conn, peer):
                        chan.send(encode_fields(ST_ERROR, [b"the rendezvous store has too many connections open"]))
                        return
                if refusal:
                    self._refused("refused_frame")
                    self._rejections.warning("rendezvous: refused a frame from %s: %s", peer, refusal)
                    chan.send(encode_fields(ST_REFUSED, [refusal.encode()]))
                    continue
                try:
                    op, fields = decode_fields(body)
                    status, out = self._dispatch(op, fields)
                except FrameError as e:
                    self._refused("malformed_request")
                    self._rejections.warning("rendezvous: closing connection from %s: malformed request (%s)", peer, e)
                    return
                finally:
                    body = fields = b""  # nothing of the frame stays referenced while the connection idles
                    self._inflight.release(held)
                if status == ST_REFUSED:
                    self._refused("refused_request")
                    self._rejections.warning("rendezvous: refused a request from %s: %s", peer, out[0].decode())
                chan.send(encode_fields(status, out))
        except OSError as e:  # socket.timeout included
            if isinstance(e, TimeoutError) and not self._closed:
                self._refused("frame_deadline" if authenticated else "first_frame_deadline")
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
                self._refusals["too_many_connections"] += 1
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
                if t.wait_for([key], I64.unpack(f[1])[0] / 1000):
                    return ST_TIMEOUT, [f[0]]
                with t.cond:
                    return ST_OK, [t.data[key]]
            if op == OP_ADD and len(f) == 2:
                key, delta = f[0].decode(), I64.unpack(f[1])[0]
                with t.cond:
                    value = int(t.data.get(key, b"0")) + delta
                    refused = t.write(key, str(value).encode())
                    if refused:
                        return ST_REFUSED, [refused.encode()]
                    t.cond.notify_all()
                return ST_OK, [I64.pack(value)]
            if op == OP_WAIT and len(f) >= 1:
                keys = [k.decode() for k in f[1:]]
                missing = t.wait_for(keys, I64.unpack(f[0])[0] / 1000)
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
                    return ST_OK, [I64.pack(len(t.data))]
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


__all__ = ["REFUSAL_CAUSES", "RendezvousServer", "frame_error_cause", "max_store_bytes"]
