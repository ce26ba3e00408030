"""The control plane's connections: every rank but 0 holds one TCP connection to rank 0's coordinator.

Frames reuse the rendezvous store's authenticated framing (HMAC-SHA256 under the job secret, a
per-connection nonce and sequence numbers), so only processes of this job can speak, and a frame
is unpickled only after its MAC checked out. Bodies are pickled lists of small tuples.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import time
from typing import Callable
from ..bootstrap.framing import HELLO_BYTES, MAGIC, NONCE_BYTES, VERSION, FrameError, FramedChannel as Channel, recv_exact

MAX_CONTROL_FRAME = 256 << 20  # a burst of thousands of full requests stays far below this
BODY_TIMEOUT = 30.0  # a peer that has started a frame must finish it this fast


class ControlError(RuntimeError):
    """The control connection could not be set up or broke."""


def send(chan: Channel, messages: list) -> None:
    chan.send(pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL))


def recv(chan: Channel) -> list:
    """One frame's messages (blocks until a whole frame is read; call when the socket is readable)."""
    return pickle.loads(chan.recv(BODY_TIMEOUT))


def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    if not socks:
        if timeout > 0:
            time.sleep(timeout)
        return []
    ready, _, _ = select.select(socks, [], [], max(0.0, timeout))
    return ready


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

    def __init__(self, secret: bytes, host: str = "0.0.0.0") -> None:
        self._secret = secret
        self._sock = socket.create_server((host, 0), backlog=1024)
        self.port = self._sock.getsockname()[1]

    def accept(self, ranks: list[int], timeout: float, interrupt: Callable[[], None] | None = None) -> dict[int, Channel]:
        """Wait for every rank in ``ranks`` to connect and identify itself; ``interrupt`` (asked
        every 0.5 s) may raise to stop waiting."""
        deadline = time.monotonic() + timeout
        chans: dict[int, Channel] = {}
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
                found = self._identify(conn, ranks)
                if found is None:
                    continue
                rank, chan = found
                if rank in chans:
                    conn.close()
                    raise ControlError(f"two processes claimed rank {rank} when connecting to the coordinator; "
                                       f"the launcher gave two processes the same rank.")
                chans[rank] = chan
        except BaseException:
            for chan in chans.values():
                chan.sock.close()
            raise
        finally:
            self._sock.close()
        return chans

    def _identify(self, conn: socket.socket, ranks: list[int]) -> tuple[int, Channel] | None:
        """The rank a new connection speaks for, after its first frame authenticated."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(NONCE_BYTES)
        chan = Channel(conn, self._secret, nonce, b"S", MAX_CONTROL_FRAME)
        try:
            conn.settimeout(BODY_TIMEOUT)
            conn.sendall(MAGIC + bytes([VERSION]) + nonce)
            hello = pickle.loads(chan.recv(BODY_TIMEOUT))  # the socket keeps this timeout: frames are read when ready
        except (OSError, FrameError, pickle.UnpicklingError, EOFError):
            conn.close()  # not one of ours (wrong secret, a port scanner): keep waiting for the real ranks
            return None
        if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "rank" and hello[1] in ranks):
            conn.close()
            return None
        return hello[1], chan

    def close(self) -> None:
        self._sock.close()


def connect(host: str, port: int, secret: bytes, rank: int, timeout: float) -> Channel:
    """Connect to the coordinator at ``host:port`` as ``rank`` (retrying until ``timeout``)."""
    deadline = time.monotonic() + timeout
    delay, last = 0.01, None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv_exact(sock, HELLO_BYTES)
            if hello[:4] != MAGIC or hello[4] != VERSION:
                sock.close()
                raise ControlError(f"{host}:{port} is not a gpucomm coordinator (it answered {hello[:5]!r}).")
            sock.settimeout(BODY_TIMEOUT)  # frames are read once select says they are arriving
            chan = Channel(sock, secret, hello[5:], b"C", MAX_CONTROL_FRAME)
            chan.send(pickle.dumps(("rank", rank)))
            return chan
        except (OSError, FrameError) as e:
            last = e
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    raise ControlError(f"rank {rank} could not connect to rank 0's coordinator at {host}:{port} within "
                       f"{timeout:.0f} s (last error: {last}). Rank 0 may have failed during init, or this host cannot "
                       f"reach it on that address (set GPUCOMM_GLOO_IFACE to the interface to use).")


__all__ = ["Channel", "ControlError", "ControlListener", "connect", "readable", "recv", "send"]
