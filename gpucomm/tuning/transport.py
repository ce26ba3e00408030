"""The network transport under NCCL: RDMA (InfiniBand / RoCE verbs) or plain TCP sockets.

NCCL's cost model (``nccl.py``, ``src/graph/tuning.cc``) does not know which transport carries its
inter-node traffic: the socket transport reports the NIC's line rate as its speed
(``ncclNetSocketGetSpeed`` reads ``/sys/class/net/<if>/speed``, 10 Gbit/s when unreadable; latency
"Not set", 0) and the topology turns it into ``bw = Gbit/s / 8`` per channel as it does for an IB
NIC. Over RDMA the NIC moves the bytes and that speed is what a channel gets. Over TCP every byte
goes through the kernel's socket calls on both hosts (the transport's ``ptrSupport`` is
``NCCL_PTR_HOST``: data is staged in pinned host memory, then ``send``/``recv`` copy it), done by a
few threads, so the host's cost per byte bounds a channel whatever the NIC's rate.

From NCCL's socket transport (NVIDIA/nccl ``src/transport/net_socket.cc`` at 5067397c, 2.30.7;
unchanged in substance since 2.5.6, ``299c554d``):

- ``NCCL_SOCKET_NTHREADS`` helper threads per connection, default **0** ("we only use the main
  thread": the proxy thread drives one socket) except on AWS (PCI vendor ``0x1d0f``: 2) and GCP
  (``0x1ae0``: 4), at most ``MAX_THREADS`` **16**;
- ``NCCL_NSOCKS_PERTHREAD`` sockets per thread, default **1** (AWS 8), the product capped at
  ``MAX_SOCKETS`` **64**;
- a message is split over the sockets in tasks of at least ``NCCL_SOCKET_MIN_TASKSIZE`` **64 KiB**
  (``MIN_CHUNKSIZE`` before 2.27.3); the first ``NCCL_SOCKET_INLINE`` **128 B** ride on the control
  socket;
- NCCL's messages are its Simple protocol's steps: ``NCCL_BUFFSIZE`` **4 MiB**
  (``DEFAULT_BUFFSIZE``, ``src/init.cc``) over ``NCCL_STEPS`` **8** (``src/include/device.h``):
  512 KiB, so one step fills at most 8 sockets and the 8 steps in flight at most 64.

Before 2.4.8 (``7c72dee6``; so every NCCL 2 of 2017-18, whose first public source is 2.3.5) there
was one socket per connection, sent and received with blocking calls on the proxy thread: the
same as today's default. 2.4.8 added the threads and sockets (default 1 x 1), 2.5.6 made the
default 0 threads.

The host's cost per byte was measured on the development machine (``benchmarks/tcp_host_cost.py``:
one loopback TCP stream, 1 MiB messages, 5 runs of 1.5 s, medians; 2-core AMD EPYC VM, 2026-11-27):
``TCP_FLOW_GBS`` is one stream's rate with one thread at each end, ``TCP_SEND_NS_PER_BYTE`` and
``TCP_RECV_NS_PER_BYTE`` the CPU time each end's thread spends per byte. Loopback has no NIC and
runs the receiver's protocol work in the sender's call, so these stand in for a real link's; pass
your own (``Socket(flow_gbs=..., ...)``) from a measurement of the machines at hand.

A channel over TCP then carries at most (GB/s)::

    streams x min(flow_gbs, flow_gbps / 8)        # each socket is one TCP flow
    workers / ns_per_byte                           # each thread's CPU

with ``streams`` the sockets in use (1 when ``threads`` is 0), ``workers`` the threads (the proxy
thread when 0, shared by all the GPU's channels) and ``ns_per_byte`` one side's cost, or both
sides' when one thread carries both a send and a receive across the network (the proxy thread of a
GPU that is alone on its node, or a tree's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["TRANSPORTS", "Socket", "SOCKET_MAX_THREADS", "SOCKET_MAX_SOCKETS", "SOCKET_MIN_TASK_BYTES",
           "SOCKET_INLINE_BYTES", "SOCKET_DEFAULTS", "NCCL_BUFFSIZE", "NCCL_STEPS", "SOCKET_UNKNOWN_SPEED_GBPS",
           "TCP_FLOW_GBS", "TCP_SEND_NS_PER_BYTE", "TCP_RECV_NS_PER_BYTE"]

TRANSPORTS = ("rdma", "tcp")
Transport = Literal["rdma", "tcp"]

# src/transport/net_socket.cc at 5067397c (2.30.7)
SOCKET_MAX_THREADS = 16  # MAX_THREADS
SOCKET_MAX_SOCKETS = 64  # MAX_SOCKETS
SOCKET_MIN_TASK_BYTES = 64 * 1024  # NCCL_SOCKET_MIN_TASKSIZE
SOCKET_INLINE_BYTES = 128  # NCCL_SOCKET_INLINE
SOCKET_DEFAULTS = {"default": (0, 1), "aws": (2, 8), "gcp": (4, 1)}  # (NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD)
SOCKET_UNKNOWN_SPEED_GBPS = 10.0  # ncclNetSocketGetSpeed: "Defaulting to 10 Gbps"
# src/init.cc DEFAULT_BUFFSIZE and src/include/device.h NCCL_STEPS: the Simple protocol's step is one message
NCCL_BUFFSIZE = 1 << 22
NCCL_STEPS = 8
# benchmarks/tcp_host_cost.py on the development machine (loopback, medians of 5 runs; module doc)
TCP_FLOW_GBS = 2.84
TCP_SEND_NS_PER_BYTE = 0.27
TCP_RECV_NS_PER_BYTE = 0.19


@dataclass(frozen=True)
class Socket:
    """NCCL's socket transport on one host: ``threads`` (``NCCL_SOCKET_NTHREADS``) and
    ``socks_per_thread`` (``NCCL_NSOCKS_PERTHREAD``) per connection, the host's per-byte costs, and
    ``flow_gbps``, a network's own limit on one TCP flow (Gbit/s; ``math.inf`` for none, as on a
    plain LAN; clouds publish one)."""

    threads: int = SOCKET_DEFAULTS["default"][0]
    socks_per_thread: int = SOCKET_DEFAULTS["default"][1]
    flow_gbs: float = TCP_FLOW_GBS
    send_ns_per_byte: float = TCP_SEND_NS_PER_BYTE
    recv_ns_per_byte: float = TCP_RECV_NS_PER_BYTE
    flow_gbps: float = math.inf

    def __post_init__(self) -> None:
        if not (isinstance(self.threads, int) and 0 <= self.threads <= SOCKET_MAX_THREADS):
            raise ValueError(f"Socket: threads={self.threads!r}; NCCL_SOCKET_NTHREADS is 0 (the proxy thread alone, "
                             f"NCCL's default) to {SOCKET_MAX_THREADS} (net_socket.cc MAX_THREADS).")
        if not (isinstance(self.socks_per_thread, int) and self.socks_per_thread >= 1):
            raise ValueError(f"Socket: socks_per_thread={self.socks_per_thread!r}; NCCL_NSOCKS_PERTHREAD must be >= 1.")
        if self.threads * self.socks_per_thread > SOCKET_MAX_SOCKETS:
            raise ValueError(f"Socket: {self.threads} threads x {self.socks_per_thread} sockets = "
                             f"{self.threads * self.socks_per_thread} sockets; NCCL allows at most "
                             f"{SOCKET_MAX_SOCKETS} per connection (net_socket.cc MAX_SOCKETS): lower socks_per_thread "
                             f"to {SOCKET_MAX_SOCKETS // max(1, self.threads)} or less.")
        for name in ("flow_gbs", "send_ns_per_byte", "recv_ns_per_byte", "flow_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"Socket: {name}={v!r} must be a number > 0.")
        if not all(math.isfinite(getattr(self, n)) for n in ("flow_gbs", "send_ns_per_byte", "recv_ns_per_byte")):
            raise ValueError("Socket: flow_gbs, send_ns_per_byte and recv_ns_per_byte must be finite (a TCP flow "
                             "always costs its hosts something per byte).")

    @classmethod
    def for_cloud(cls, name: str, **kw) -> "Socket":
        """The threads and sockets NCCL picks by itself on ``name``: ``"default"``, ``"aws"`` or ``"gcp"``."""
        if name not in SOCKET_DEFAULTS:
            raise ValueError(f"Socket.for_cloud: {name!r}; NCCL auto-detects {', '.join(SOCKET_DEFAULTS)}.")
        threads, socks = SOCKET_DEFAULTS[name]
        return cls(threads=threads, socks_per_thread=socks, **kw)

    @property
    def sockets(self) -> int:
        """Data sockets per connection (0: the proxy thread sends on the control socket)."""
        return self.threads * self.socks_per_thread

    @property
    def streams(self) -> int:
        """TCP flows one connection keeps busy: its sockets, no more than NCCL's steps in flight fill
        (``NCCL_STEPS`` steps of ``NCCL_BUFFSIZE / NCCL_STEPS`` split into 64 KiB tasks); 1 with no
        helper threads."""
        if self.threads == 0:
            return 1
        per_step = max(1, (NCCL_BUFFSIZE // NCCL_STEPS) // SOCKET_MIN_TASK_BYTES)
        return min(self.sockets, NCCL_STEPS * per_step)

    @property
    def workers(self) -> int:
        """Threads doing one connection's socket calls (the proxy thread when ``threads`` is 0)."""
        return max(1, self.threads)

    def channel_gbs(self, channels: int = 1, both_directions: bool = False) -> float:
        """The most one channel carries over TCP (GB/s, NCCL's 1e9 B/s): ``channels`` that leave the
        node by the same GPU share its proxy thread when there are no helper threads; ``both_directions`` when one thread
        carries a send and a receive across the network (module doc)."""
        if channels < 1:
            raise ValueError(f"Socket.channel_gbs: channels={channels} must be >= 1.")
        flows = self.streams * min(self.flow_gbs, self.flow_gbps / 8.0)
        shared = both_directions and self.threads == 0
        ns = self.send_ns_per_byte + self.recv_ns_per_byte if shared else max(self.send_ns_per_byte,
                                                                               self.recv_ns_per_byte)
        cpu = self.workers / ns  # bytes per ns = GB/s
        if self.threads == 0:
            cpu /= channels
        return min(flows, cpu)

    def to_dict(self) -> dict:
        return {"threads": self.threads, "socks_per_thread": self.socks_per_thread, "sockets": self.sockets,
                "streams": self.streams, "flow_gbs": self.flow_gbs, "send_ns_per_byte": self.send_ns_per_byte,
                "recv_ns_per_byte": self.recv_ns_per_byte,
                "flow_gbps": "inf" if self.flow_gbps == math.inf else self.flow_gbps}
