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

The server is ``store_server.py`` (its limits on hostile or broken peers are described there) and
the wire protocol ``store_protocol.py``; this module is the client, and the public face of both.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ..settings import DEFAULT_LIVENESS_S
from .keepalive import bound_dead_peer
from .netaddr import host_port, unbracket
from .framing import (DENY, HELLO_BYTES, MAGIC, VERSION, FrameError, FramedChannel, decode_fields, encode_fields,
                      recv_exact)
from ..errors import RendezvousError, RendezvousAuthError, RendezvousRefused, RendezvousTimeout, RendezvousUnreachable
from .store_protocol import (DEFAULT_MAX_FRAME, FIRST_FRAME_SECONDS, I64, OP_ADD, OP_CHECK, OP_COMPARE_SET, OP_DELETE,
                             OP_GET, OP_NUM_KEYS, OP_PING, OP_SET, OP_WAIT, ST_ERROR, ST_OK, ST_REFUSED, ST_TIMEOUT,
                             shut)
from .store_server import RendezvousServer, max_store_bytes

log = logging.getLogger("gpucomm.rendezvous")


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
        self.host, self.port = unbracket(host), port  # (an IPv6 address may come written as in a URL)
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
                        f"{host_port(self.host, self.port)} is not a gpucomm rendezvous store (version {VERSION}): it answered "
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
                if e.kind == "deny":
                    sock.close()
                    raise RendezvousAuthError(
                        f"the rendezvous store at {host_port(self.host, self.port)} rejected this process's frames: its job "
                        f"secret differs from ours. Every rank of one job must share GPUCOMM_SECRET (gpucomm-run sets "
                        f"it); a process from another job may be using the same address and port.") from None
                last_error = e
            except ConnectionRefusedError as e:
                if self._connected_once:  # it was up, and nothing listens there now: it is gone
                    raise RendezvousError(
                        f"the gpucomm rendezvous store at {host_port(self.host, self.port)} stopped listening ({e}): the "
                        f"process serving it (rank 0, or the launcher) has exited or failed. Its own output says "
                        f"why.") from None
                last_error = e
            except OSError as e:
                last_error = e
            if time.monotonic() + delay > deadline:
                raise RendezvousUnreachable(
                    f"could not reach the gpucomm rendezvous store at {host_port(self.host, self.port)} within "
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
                raise RendezvousError(f"the rendezvous store at {host_port(self.host, self.port)} is gone: {self._gone}")
            if self._closed:
                raise RendezvousError("the rendezvous client is closed (gpucomm was shut down)")
            chan = self._idle.pop() if self._idle else None
        if chan is None:
            chan = self._connect()
        with self._lock:
            self._busy.add(chan)
            if self._closed:
                shut(chan.sock)
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
            shut(c.sock)

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
            if e.kind == "deny":
                raise RendezvousAuthError(
                    f"the rendezvous store at {host_port(self.host, self.port)} rejected this process's frames: its job secret "
                    f"differs from ours. Every rank of one job must share GPUCOMM_SECRET (gpucomm-run sets it); a "
                    f"process from another job may be using the same address and port.") from None
            raise RendezvousError(f"rendezvous store at {host_port(self.host, self.port)} broke the connection: {e}. "
                                  f"{self._lost_why()}") from None
        except OSError as e:
            self._release(chan, broken=True)
            raise RendezvousError(f"rendezvous store at {host_port(self.host, self.port)} failed: {e}. "
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
        status, out = self._request(OP_GET, [key.encode(), I64.pack(int(t * 1000))])
        if status == ST_TIMEOUT:
            raise RendezvousTimeout(f"key {key!r} was not set within {t:.1f} s", [key])
        return out[0]

    def add(self, key: str, delta: int, *, within: float | None = None) -> int:
        """Add ``delta`` to the counter ``key`` and return its new value (``within``: see ``_request``)."""
        return I64.unpack(self._request(OP_ADD, [key.encode(), I64.pack(delta)], within)[1][0])[0]

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key exists; ``RendezvousTimeout.missing`` lists the absent ones."""
        t = self.timeout if timeout is None else timeout
        status, out = self._request(OP_WAIT, [I64.pack(int(t * 1000))] + [k.encode() for k in keys])
        if status == ST_TIMEOUT:
            missing = [k.decode() for k in out]
            raise RendezvousTimeout(f"{len(missing)} of {len(keys)} keys were not set within {t:.1f} s: "
                                    f"{', '.join(missing[:10])}", missing)

    def check(self, keys: Sequence[str]) -> bool:
        return self._request(OP_CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def delete(self, key: str) -> bool:
        return self._request(OP_DELETE, [key.encode()])[1][0] == b"1"

    def num_keys(self) -> int:
        return I64.unpack(self._request(OP_NUM_KEYS, [])[1][0])[0]

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
            f"{host_port(client.host, client.port)}; or the job size is wrong. Check their logs (gpucomm-run prefixes "
            f"each line with its rank) and raise GPUCOMM_START_TIMEOUT if they only start slowly.",
            e.missing) from None


def barrier(client: RendezvousClient, name: str, rank: int, size: int, timeout: float) -> None:
    """All ``size`` ranks meet at ``name``; a timeout names the absent ranks."""
    client.set(f"{name}/{rank}", b"1")
    wait_for_ranks(client, name, range(size), timeout, f"'{name}'")


# the public face of the store: its client (here), its server and the protocol names callers use
__all__ = ["DEFAULT_MAX_FRAME", "FIRST_FRAME_SECONDS", "HELLO_BYTES", "OP_PING", "OP_SET", "RendezvousAuthError",
           "RendezvousClient", "RendezvousError", "RendezvousRefused", "RendezvousServer", "RendezvousTimeout",
           "RendezvousUnreachable", "barrier", "max_store_bytes", "wait_for_ranks"]
