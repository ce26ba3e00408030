"""Bounded detection of a peer that dropped off the network, for long-lived TCP connections.

A host whose link is cut (or that loses power) sends no reset: the other end's socket stays open.
An idle connection then never notices, and one with data in flight retries for TCP's retransmission
limit (``tcp_retries2``: about 15 minutes on Linux) before its call fails. ``bound_dead_peer`` makes
the kernel give up after ``seconds`` instead: keepalive probes once the connection has been idle for
a quarter of it, and ``TCP_USER_TIMEOUT`` (Linux) for data and probes left unacknowledged. A call
blocked on such a socket then fails with ``ETIMEDOUT`` ("Connection timed out").

gpucomm uses it on the rendezvous store's connections (the ranks' requests, and the store's side of
them), with ``GPUCOMM_LIVENESS_TIMEOUT`` as the bound.
"""

from __future__ import annotations

import socket

__all__ = ["bound_dead_peer", "keepalive_options"]


def keepalive_options(seconds: float) -> list[tuple[int, int, int]]:
    """The ``(level, option, value)`` triples ``bound_dead_peer`` sets for ``seconds`` (those this
    platform's ``socket`` module knows)."""
    probe = max(1, int(seconds / 4))
    wanted = [(socket.SOL_SOCKET, "SO_KEEPALIVE", 1), (socket.IPPROTO_TCP, "TCP_KEEPIDLE", probe),
              (socket.IPPROTO_TCP, "TCP_KEEPINTVL", probe), (socket.IPPROTO_TCP, "TCP_KEEPCNT", 4),
              (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", max(1000, int(seconds * 1000)))]
    return [(level, getattr(socket, name), value) for level, name, value in wanted if hasattr(socket, name)]


def bound_dead_peer(sock: socket.socket, seconds: float | None) -> None:
    """Let ``sock`` fail with ``ETIMEDOUT`` once its peer has acknowledged nothing for about
    ``seconds`` (None or 0: the system's defaults stay). Best effort: an option the socket refuses
    (not TCP, not Linux) is skipped."""
    if not seconds:
        return
    for level, option, value in keepalive_options(seconds):
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass
