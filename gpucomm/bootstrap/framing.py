"""Authenticated framing, shared by the rendezvous store and the control channels.

After the server's hello ``b"GPCM" + version + 16-byte nonce``, every frame (both directions) is::

    u32 big-endian length L | 32-byte MAC | body (L - 32 bytes)
    MAC = HMAC-SHA256(secret, nonce | direction byte | u64 sequence number | body)

The per-connection nonce and sequence numbers stop a recorded frame from being replayed; reads
are bounded, so a broken or hostile peer cannot make a reader allocate without limit: a reader may
pass a smaller ``limit`` until the peer has authenticated (the store allows 4 KiB before the first
good MAC), and a ``deadline`` that covers the whole frame, so a peer that trickles bytes cannot
hold a reader longer than that. A reader that will not take a frame (too large for it now) can
read its header alone (``recv_header``) and drop the body unread into memory (``skip_body``, MAC
still checked), so that it can answer why instead of closing the connection.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
import time
from collections.abc import Iterable
from ..errors import FrameError

MAGIC = b"GPCM"
VERSION = 2  # 2: clients authenticate with a first frame at once (the store closes silent connections)
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + 1 + NONCE_BYTES
DENY = b"\x00\x00\x00\x00DENY"

_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
SKIP_CHUNK = 1 << 20  # a refused frame is read and dropped this much at a time


def encode_fields(op: int, fields: Iterable[bytes]) -> bytes:
    parts = [bytes([op])]
    for f in fields:
        parts.append(_LEN.pack(len(f)))
        parts.append(f)
    return b"".join(parts)


def decode_fields(body: bytes) -> tuple[int, list[bytes]]:
    if not body:
        raise FrameError("empty body")
    op, pos, fields = body[0], 1, []
    while pos < len(body):
        if pos + 4 > len(body):
            raise FrameError("truncated field length")
        (n,) = _LEN.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise FrameError(f"field of {n} bytes overruns the frame")
        fields.append(body[pos : pos + n])
        pos += n
    return op, fields


def mac(secret: bytes, nonce: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    return hmac.digest(secret, nonce + direction + _SEQ.pack(seq) + body, "sha256")


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_SLACK_S = 0.01  # a socket timeout this much past the deadline still counts as within it


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``; with a ``deadline`` (``time.monotonic()``), all of them by then
    (FrameError otherwise; the socket's timeout is restored)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    if n == 0:
        return b""
    previous = sock.gettimeout() if deadline is not None else None
    # Usually all there already: read it without switching the socket's timeout (two syscalls). On a
    # socket with a timeout of its own Python first waits up to that timeout for data, so only where
    # that wait cannot outlast the deadline (the control plane's sockets: their timeout is the body's).
    if deadline is not None and _DONTWAIT and (not previous or previous <= deadline - time.monotonic() + _SLACK_S):
        try:
            got = sock.recv_into(view, n, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            got = 0
        except socket.timeout:
            raise FrameError(f"frame not complete in time (0 of {n} bytes)", "deadline") from None
        else:
            if got == 0:
                raise FrameError(f"connection closed after 0 of {n} bytes", "closed")
            if got == n:
                return bytes(buf)
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FrameError(f"frame not complete in time ({got} of {n} bytes)", "deadline", got)
                sock.settimeout(left)
            try:
                k = sock.recv_into(view[got:], n - got)
            except socket.timeout:
                if deadline is None:
                    raise
                raise FrameError(f"frame not complete in time ({got} of {n} bytes)", "deadline", got) from None
            if k == 0:
                raise FrameError(f"connection closed after {got} of {n} bytes", "closed", got)
            got += k
    finally:
        if deadline is not None:
            sock.settimeout(previous)
    return bytes(buf)


class FramedChannel:
    """One authenticated, sequenced connection end (used by both server and client)."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, send_dir: bytes, max_frame: int):
        self.sock, self.secret, self.nonce = sock, secret, nonce
        self.send_dir = send_dir
        self.recv_dir = b"S" if send_dir == b"C" else b"C"
        self.max_frame = max_frame
        self.send_seq = self.recv_seq = 0
        self._send_lock = threading.Lock()  # frames from several threads (e.g. heartbeats) never interleave

    def send(self, body: bytes) -> None:
        with self._send_lock:
            tag = mac(self.secret, self.nonce, self.send_dir, self.send_seq, body)
            self.send_seq += 1
            self.sock.sendall(_LEN.pack(MAC_BYTES + len(body)) + tag + body)

    def recv(self, body_timeout: float | None, *, limit: int | None = None, deadline: float | None = None) -> bytes:
        """The next frame's body. ``body_timeout``: once the header is in, the rest must arrive within
        it; ``deadline`` (monotonic): the whole frame, header included, by then; ``limit``: the
        largest body accepted now (default ``max_frame``), checked before anything is allocated."""
        length = self.recv_header(deadline)
        cap = self.max_frame if limit is None else min(limit, self.max_frame)
        if length > cap + MAC_BYTES:
            raise FrameError(f"frame length {length} outside [{MAC_BYTES + 1}, {cap + MAC_BYTES}]")
        if body_timeout is not None:
            by = time.monotonic() + body_timeout
            deadline = by if deadline is None else min(deadline, by)
        return self.recv_body(length, deadline)

    def recv_header(self, deadline: float | None = None) -> int:
        """The next frame's length prefix (MAC included), at least ``MAC_BYTES + 1``; a ``DENY``
        marker raises ``FrameError("DENY", "deny")``. Nothing is allocated for the body yet."""
        header = recv_exact(self.sock, 4, deadline)
        if header == DENY[:4]:
            rest = recv_exact(self.sock, 4, deadline)
            raise FrameError("DENY", "deny") if rest == DENY[4:] else FrameError("zero-length frame")
        (length,) = _LEN.unpack(header)
        if length < MAC_BYTES + 1:
            raise FrameError(f"frame length {length} is below the minimum of {MAC_BYTES + 1}")
        return length

    def recv_body(self, length: int, deadline: float | None) -> bytes:
        """The rest of a frame whose header announced ``length``: read, MAC-checked, sequenced."""
        payload = recv_exact(self.sock, length, deadline)
        tag, body = payload[:MAC_BYTES], payload[MAC_BYTES:]
        if not hmac.compare_digest(tag, mac(self.secret, self.nonce, self.recv_dir, self.recv_seq, body)):
            raise FrameError("bad MAC", "mac")
        self.recv_seq += 1
        return body

    def skip_body(self, length: int, deadline: float | None, chunk: int = SKIP_CHUNK) -> None:
        """Read and drop the rest of a frame (a refused one) in ``chunk``-sized pieces, so it costs no
        memory; its MAC is still checked (streamed), so the connection stays in step and
        authenticated, and the sender can be told why its frame was refused."""
        tag = recv_exact(self.sock, MAC_BYTES, deadline)
        h = hmac.new(self.secret, self.nonce + self.recv_dir + _SEQ.pack(self.recv_seq), "sha256")
        left = length - MAC_BYTES
        while left:
            piece = recv_exact(self.sock, min(chunk, left), deadline)
            h.update(piece)
            left -= len(piece)
        if not hmac.compare_digest(tag, h.digest()):
            raise FrameError("bad MAC", "mac")
        self.recv_seq += 1

__all__ = ["DENY", "FrameError", "FramedChannel", "HELLO_BYTES", "MAC_BYTES", "MAGIC", "NONCE_BYTES", "SKIP_CHUNK", "VERSION",
           "decode_fields", "encode_fields", "mac", "recv_exact"]
