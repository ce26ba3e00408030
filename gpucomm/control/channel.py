"""The control plane's connections: every rank but 0 holds one TCP connection to rank 0's coordinator.

Frames reuse the rendezvous store's authenticated framing (HMAC-SHA256 under the job secret, a
per-connection nonce and sequence numbers), so only processes of this job can speak, and a frame
is unpickled only after its MAC checked out. Bodies are pickled lists of small tuples.

A connecting rank's first frame says who it is: ``("rank", rank, host, pid)``. Rank 0 checks it
against the process that arrived at the store as that rank; any other claim of a rank (a second
connection for it, a process that did not arrive as it, or any claim once every rank is connected)
is a second claimant, reported with both (host, pid) so that the job can be failed with them.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import threading
import time
from typing import Callable, Mapping

from ..bootstrap.framing import HELLO_BYTES, MAGIC, NONCE_BYTES, VERSION, FrameError, FramedChannel as Channel, recv_exact
from ..bootstrap.arrival import duplicate_claim
from ..bootstrap.netaddr import host_port, listening_socket
from ..counters import COUNTERS
from ..dataplane.activity import BACKWARDS, backward_running
from ..errors import ControlError

log = logging.getLogger("gpucomm.control")

MAX_CONTROL_FRAME = 256 << 20  # a burst of thousands of full requests stays far below this
BODY_TIMEOUT = 30.0  # a peer that has started a frame must finish it this fast
HELLO_SECONDS = 10.0  # connect -> the identifying first frame
HELLO_MAX = 4096  # the largest first frame read from a peer that has not authenticated yet

Claimant = tuple[str, object]  # (host, pid) as a process states it


def send(chan: Channel, messages: list) -> None:
    chan.send(pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL))


def recv(chan: Channel) -> list:
    """One frame's messages (blocks until a whole frame is read; call when the socket is readable)."""
    return pickle.loads(chan.recv(BODY_TIMEOUT))


def readable(socks: list[socket.socket | int], timeout: float, spin: float = 0.0) -> list[socket.socket | int]:
    """The members of ``socks`` (sockets or fds) with data to read, waiting up to ``timeout`` s.
    ``spin``: first poll them without sleeping for up to that many seconds. A process woken from
    ``select`` on a shared machine pays tens of microseconds before it runs again (measured here:
    a 4 KiB ping-pong takes ~100 us blocking, ~17 us polling), which is most of a small
    synchronous collective's round; a caller about to block on an answer that is due within
    microseconds polls first (see ``ControlConfig.spin``). No polling while a gradient-hook
    backward runs (``backward_running()``): every poll takes the GIL back from autograd's hook
    threads, so a poll is skipped, or stopped as soon as a backward begins, and counted."""
    if not socks:
        if timeout > 0:
            time.sleep(timeout)
        return []
    timeout = max(0.0, timeout)
    if spin > 0.0 and timeout > 0.0:
        if backward_running():
            COUNTERS.spin_skipped_backward += 1
        else:
            ready, timeout = poll(socks, timeout, min(spin, timeout))
            if ready:
                return ready
    return wait_readable(socks, timeout)


def wait_readable(socks: list[socket.socket | int], timeout: float) -> list[socket.socket | int]:
    """``select`` on ``socks`` for up to ``timeout`` s, tolerating a socket that another thread closed
    meanwhile (a peer that left, closed by the thread serving it while this one took the list): the
    closed ones are dropped and the rest are asked again, at once. What is closed has nothing to
    read; the caller takes its list again on its next round. (Before: ``OSError: [Errno 9] Bad
    file descriptor`` ended the control thread at shutdown.)"""
    try:
        ready, _, _ = select.select(socks, [], [], timeout)
        return ready
    except (OSError, ValueError):
        alive = [s for s in socks if _is_open(s)]
        if len(alive) == len(socks):
            raise  # not a closed socket: a real error
        if not alive:
            return []
        ready, _, _ = select.select(alive, [], [], 0.0)
        return ready


def _is_open(sock: socket.socket | int) -> bool:
    """Whether ``sock`` (a socket or an fd) still names an open file descriptor."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    if fd < 0:
        return False
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def poll(socks: list[socket.socket | int], timeout: float, spin: float) -> tuple[list[socket.socket | int], float]:
    """Poll ``socks`` without sleeping for up to ``spin`` s, or until a gradient-hook backward
    begins: (the readable ones, what is left of ``timeout`` after the time really spent, since a
    poller may be descheduled)."""
    start = time.perf_counter()
    end = start + spin
    backwards = BACKWARDS  # read on every poll without a call: the loop adds no Python call per poll
    while True:
        try:
            ready, _, _ = select.select(socks, [], [], 0.0)
        except (OSError, ValueError):  # a socket closed meanwhile (a peer left): what is left, once
            return wait_readable(socks, 0.0), max(0.0, timeout - (time.perf_counter() - start))
        if ready:
            return ready, 0.0
        now = time.perf_counter()
        if now >= end:
            break
        if backwards[0]:
            COUNTERS.spin_skipped_backward += 1
            break
    return [], max(0.0, timeout - (now - start))


class Waker:
    """A pipe that interrupts ``readable``: ``fd`` goes in its list, ``wake()`` makes it readable."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:  # closed, or the pipe is full: the reader is awake anyway
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class ControlListener:
    """Rank 0's listening socket; ``accept`` returns one authenticated channel per other rank."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1") -> None:
        self._secret = secret
        self._sock = listening_socket(host, 0, backlog=1024)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._watcher: threading.Thread | None = None

    def accept(self, ranks: list[int], timeout: float, interrupt: Callable[[], None] | None = None, *,
               claimants: Mapping[int, Claimant] | None = None,
               on_conflict: Callable[[str], None] | None = None) -> dict[int, Channel]:
        """Wait for every rank in ``ranks`` to connect and identify itself; ``interrupt`` (asked
        every 0.5 s) may raise to stop waiting. ``claimants``: the (host, pid) that arrived at the
        store as each rank; a connection claiming a rank for another process, or a rank already
        connected, is refused and reported to ``on_conflict`` (without it: ``ControlError``). With
        ``on_conflict`` the socket stays open afterwards and every later claim is reported the same
        way, until ``close()``."""
        deadline = time.monotonic() + timeout
        chans: dict[int, Channel] = {}
        who: dict[int, Claimant] = {}
        try:
            while len(chans) < len(ranks):
                remaining = deadline - time.monotonic()
                if interrupt is not None and remaining > 0:
                    interrupt()
                    if not readable([self._sock], min(remaining, 0.5)):
                        continue
                elif remaining <= 0 or not readable([self._sock], remaining):
                    missing = sorted(set(ranks) - set(chans))
                    raise ControlError(
                        f"ranks {missing} did not connect to rank 0's coordinator within {timeout:.0f} s. Likely "
                        f"causes: they failed during init (see their output), or they cannot reach rank 0 on port "
                        f"{self.port} (a firewall; or the wrong interface: set GPUCOMM_GLOO_IFACE).")
                conn, peer = self._sock.accept()
                found = self._identify(conn, ranks + ([0] if claimants else []))
                if found is None:
                    continue
                rank, claimant, chan = found
                holder = who.get(rank) or (claimants or {}).get(rank)
                if rank in chans or (holder is not None and not _same(holder, claimant)) or rank not in ranks:
                    message = duplicate_claim(rank, holder, claimant, peer, "connecting to rank 0's coordinator")
                    _refuse(chan, message)
                    if on_conflict is None:
                        raise ControlError(message)
                    log.error("gpucomm: %s", message)
                    on_conflict(message)
                    continue
                chans[rank], who[rank] = chan, claimant
        except BaseException:
            for chan in chans.values():
                chan.sock.close()
            self.close()
            raise
        if on_conflict is None:
            self.close()
        else:
            holders = {**(claimants or {}), **who}
            self._watcher = threading.Thread(target=self._watch_late_claims, args=(holders, on_conflict),
                                             name="gpucomm-control-claims", daemon=True)
            self._watcher.start()
        return chans

    def _watch_late_claims(self, holders: Mapping[int, Claimant], on_conflict: Callable[[str], None]) -> None:
        """Every rank is connected: any authenticated claim now is a second claimant."""
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            found = self._identify(conn, list(holders))
            if found is None or self._closed:
                continue
            rank, claimant, chan = found
            message = duplicate_claim(rank, holders.get(rank), claimant, peer,
                                      "connecting to rank 0's coordinator after every rank had connected")
            _refuse(chan, message)
            log.error("gpucomm: %s", message)
            on_conflict(message)

    def _identify(self, conn: socket.socket, ranks: list[int]) -> tuple[int, Claimant, Channel] | None:
        """The rank a new connection claims and the (host, pid) it states, after its first frame
        authenticated; None (connection closed) for anything else."""
        nonce = os.urandom(NONCE_BYTES)
        chan = Channel(conn, self._secret, nonce, b"S", MAX_CONTROL_FRAME)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HELLO_SECONDS)
            conn.sendall(MAGIC + bytes([VERSION]) + nonce)
            # bounded before authentication: a stranger's header cannot make rank 0 allocate much
            hello = pickle.loads(chan.recv(None, limit=HELLO_MAX, deadline=time.monotonic() + HELLO_SECONDS))
            conn.settimeout(BODY_TIMEOUT)  # kept: later frames are read once select says they are arriving
        except Exception:  # noqa: BLE001 - wrong secret, a port scanner, a malformed hello: keep waiting
            conn.close()
            return None
        if not (isinstance(hello, tuple) and len(hello) in (2, 4) and hello[0] == "rank" and hello[1] in ranks):
            conn.close()
            return None
        claimant: Claimant = (str(hello[2]), hello[3]) if len(hello) == 4 else ("an unnamed host", "unknown")
        return hello[1], claimant, chan

    def close(self) -> None:
        """Stop listening (and watching for late claims)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=HELLO_SECONDS + 1)


def _refuse(chan: Channel, message: str) -> None:
    """Tell a second claimant why it is turned away (a gpucomm rank fails with it), then close."""
    try:
        send(chan, [("abort", message)])
    except OSError:
        pass
    chan.sock.close()


def _same(a: Claimant, b: Claimant) -> bool:
    return str(a[0]) == str(b[0]) and str(a[1]) == str(b[1])


def connect(host: str, port: int, secret: bytes, rank: int, timeout: float, *, me: str | None = None) -> Channel:
    """Connect to the coordinator at ``host:port`` as ``rank`` (retrying until ``timeout``); ``me``
    is this process's host name as it arrived at the store (default: the kernel's)."""
    identity = ("rank", rank, me or socket.gethostname(), os.getpid())
    deadline = time.monotonic() + timeout
    delay, last = 0.01, None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv_exact(sock, HELLO_BYTES)
            if hello[:4] != MAGIC or hello[4] != VERSION:
                sock.close()
                raise ControlError(f"{host_port(host, port)} is not a gpucomm coordinator (it answered {hello[:5]!r}).")
            sock.settimeout(BODY_TIMEOUT)  # frames are read once select says they are arriving
            chan = Channel(sock, secret, hello[5:], b"C", MAX_CONTROL_FRAME)
            chan.send(pickle.dumps(identity))
            return chan
        except (OSError, FrameError) as e:
            last = e
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    raise ControlError(f"rank {rank} could not connect to rank 0's coordinator at {host_port(host, port)} within "
                       f"{timeout:.0f} s (last error: {last}). Rank 0 may have failed during init, or this host cannot "
                       f"reach it on that address (set GPUCOMM_GLOO_IFACE to the interface to use).")


__all__ = ["Channel", "ControlError", "ControlListener", "connect", "readable", "recv", "send"]
