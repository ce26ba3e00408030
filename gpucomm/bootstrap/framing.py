"""Authenticated framing, shared by the rendezvous store and the control channels.

After the server's hello ``b"GPCM" + version + 16-byte nonce``, every frame (both directions) is::

    u32 big-endian length L | 32-byte MAC | body (L - 32 bytes)
    MAC = HMAC-SHA256(secret, nonce | direction byte | u64 sequence number | body)

The per-connection nonce and sequence numbers stop a recorded frame from being replayed; reads
are bounded, so a broken or hostile peer cannot make a reader allocate without limit.
"""

from __future__ import annotations

import hmac
import socket
import struct
from collections.abc import Iterable

MAGIC = b"GPCM"
VERSION = 1
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + 1 + NONCE_BYTES
DENY = b"\x00\x00\x00\x00DENY"

_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class FrameError(Exception):
    """A frame broke the protocol (internal: the connection is closed)."""


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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


class FramedChannel:
    """One authenticated, sequenced connection end (used by both server and client)."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, send_dir: bytes, max_frame: int):
        self.sock, self.secret, self.nonce = sock, secret, nonce
        self.send_dir = send_dir
        self.recv_dir = b"S" if send_dir == b"C" else b"C"
        self.max_frame = max_frame
        self.send_seq = self.recv_seq = 0

    def send(self, body: bytes) -> None:
        tag = mac(self.secret, self.nonce, self.send_dir, self.send_seq, body)
        self.send_seq += 1
        self.sock.sendall(_LEN.pack(MAC_BYTES + len(body)) + tag + body)

    def recv(self, body_timeout: float | None) -> bytes:
        header = recv_exact(self.sock, 4)
        if header == DENY[:4]:
            rest = recv_exact(self.sock, 4)
            raise FrameError("DENY" if rest == DENY[4:] else "zero-length frame")
        (length,) = _LEN.unpack(header)
        if length < MAC_BYTES + 1 or length > self.max_frame + MAC_BYTES:
            raise FrameError(f"frame length {length} outside [{MAC_BYTES + 1}, {self.max_frame + MAC_BYTES}]")
        previous = self.sock.gettimeout()
        if previous == body_timeout:
            payload = recv_exact(self.sock, length)
        else:
            self.sock.settimeout(body_timeout)
            try:
                payload = recv_exact(self.sock, length)
            finally:
                self.sock.settimeout(previous)
        tag, body = payload[:MAC_BYTES], payload[MAC_BYTES:]
        if not hmac.compare_digest(tag, mac(self.secret, self.nonce, self.recv_dir, self.recv_seq, body)):
            raise FrameError("bad MAC")
        self.recv_seq += 1
        return body


__all__ = ["DENY", "FrameError", "FramedChannel", "HELLO_BYTES", "MAC_BYTES", "MAGIC", "NONCE_BYTES", "VERSION",
           "decode_fields", "encode_fields", "mac", "recv_exact"]
