"""The bootstrap store's wire protocol, shared by its server (``store_server.py``) and client
(``rendezvous.py``): opcodes, statuses and limits. Frames are authenticated and sequenced
(``framing.py``); a body is one opcode byte followed by fields, each ``u32 length | bytes``.
"""

from __future__ import annotations

import socket
import struct

from ..settings import STORE_MAX_BYTES

DEFAULT_MAX_FRAME = 64 << 20  # the NCCL id is 128 B and Gloo's addresses ~100 B; 64 MiB is generous
PREAUTH_MAX_FRAME = 4096  # the largest frame read from a peer that has not authenticated yet
FIRST_FRAME_SECONDS = 5.0  # connect -> first authenticated frame
FRAME_SECONDS = 30.0  # first byte -> last byte of any later frame
MAX_PENDING = 512  # connections not yet authenticated; beyond it the oldest is closed
MAX_CONNECTIONS = 4096  # authenticated connections
MAX_BYTES_VAR = STORE_MAX_BYTES.names[0]
DEFAULT_MAX_BYTES = 128 << 20  # values written by ranks, and (separately) frames being received
SMALL_FRAME = 64 << 10  # frames up to this size need no reservation (NCCL ids, addresses, arrival records)

I64 = struct.Struct(">q")  # the protocol's 64-bit integers (big-endian)

OP_SET, OP_GET, OP_ADD, OP_WAIT, OP_CHECK, OP_DELETE, OP_NUM_KEYS, OP_COMPARE_SET, OP_PING = range(1, 10)
ST_OK, ST_TIMEOUT, ST_ERROR, ST_REFUSED = 0, 1, 2, 3


def shut(conn: socket.socket) -> None:
    """Shut a connection down both ways (waking a thread blocked on it); errors ignored."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_FRAME", "FIRST_FRAME_SECONDS", "FRAME_SECONDS", "I64", "MAX_BYTES_VAR",
           "MAX_CONNECTIONS", "MAX_PENDING", "OP_ADD", "OP_CHECK", "OP_COMPARE_SET", "OP_DELETE", "OP_GET",
           "OP_NUM_KEYS", "OP_PING", "OP_SET", "OP_WAIT", "PREAUTH_MAX_FRAME", "SMALL_FRAME", "ST_ERROR", "ST_OK",
           "ST_REFUSED", "ST_TIMEOUT", "shut"]
