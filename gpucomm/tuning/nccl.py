"""NCCL's own cost model of an allreduce, for clusters we do not have.

Transcribed from NVIDIA/nccl ``src/graph/tuning.cc`` (``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``) at commit 5067397c, NCCL **2.30.7** (``makefiles/version.mk``), with the
bandwidth constants of ``src/graph/topo.h`` and the speed steps of ``src/graph/search.cc``. Latencies
are microseconds, bandwidths GB/s (1e9 B/s) per channel, as NCCL writes them; ``time_s`` returns
seconds. NCCL predicts ``time = latency + nBytes / (1000 * bandwidth)`` µs for each algorithm
(ring, tree) and protocol (LL, LL128, Simple) and runs the fastest; so does ``NcclModel.time_s``
with ``algorithm="auto"``.

What the model does not see, NCCL's topology search decides at run time (how many channels, at
what speed). ``graph_for`` stands in for that search with its rules for the plain cases: a ring
leaves each node through one NIC per channel at the fastest step of ``search.cc``'s speed array
that the NIC carries (``bw = Gbit/s / 8`` as ``topo.cc`` computes it), one channel per NIC; inside a
node the GPUs' link bandwidth (NVLink: links x the per-link constant of the GPU generation; PCIe: 12
GB/s) bounds the channels. Pass an explicit ``Graph`` where you know better (e.g. from
``NCCL_DEBUG_SUBSYS=TUNING`` output of the real machine).

NCCL's model does not know the transport (``transport.py``): its socket transport reports the NIC's
line rate, so NCCL picks its algorithm and protocol as if every network ran at that rate. A
``Cluster(transport="tcp")`` keeps NCCL's pick (``choice``) but times it with each network channel
capped at what the socket transport's threads and sockets carry (``Socket.channel_gbs``):
``graph`` is what NCCL believes, ``actual_graph`` what runs. ``transport="rdma"`` (the default) is
NCCL's model unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from .transport import TRANSPORTS, Socket

__all__ = ["NCCL_VERSION", "Cluster", "Graph", "graph_for", "NcclModel", "ALGORITHMS", "PROTOCOLS", "TRANSPORTS"]

NCCL_VERSION = "2.30.7 (NVIDIA/nccl 5067397c, src/graph/tuning.cc)"
ALGORITHMS = ("tree", "ring")
PROTOCOLS = ("LL", "LL128", "Simple")
_A = {"tree": 0, "ring": 1}
_P = {"LL": 0, "LL128": 1, "Simple": 2}

# tuning.cc ncclTunerConstantsDefaults, rows (LL, LL128, Simple)
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
# [row][N1, N2, N4+]; llMaxBws rows: 0 Volta-N1 / Intel multi-node, 1 Ampere-N1 / AMD multi-node, 2 Hopper, 3 Blackwell
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
PER_CH_MAX_RING_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
PER_CH_MAX_TREE_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
# ncclTopoGetAlgoTime: tree bandwidth correction per log2(nBytes / 64), 64 B .. 256 MiB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
# topo.h: per-link NVLink bandwidth by compute capability, PCIe Gen3 x16
NVLINK_BW = ((100, 40.1), (90, 20.6), (86, 12.0), (80, 20.0), (70, 20.0), (60, 18.0))
PCI_BW = 12.0
# search.cc speed steps (GB/s per channel) before Hopper; Hopper and Blackwell have their own
SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SPEEDS_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24,
                0.12)
SPEEDS_INTER_SM90 = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)
SPEEDS_INTER_SM100 = (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
                      2.4, 1.2, 0.24, 0.12)
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}


def _log2i(n: int) -> int:
    """NCCL's log2Down: floor(log2(n)), -1 for 0."""
    return n.bit_length() - 1


@dataclass(frozen=True)
class Cluster:
    """A data-parallel job's machines: ``gpus_per_node`` GPUs on each of ``nodes`` nodes.

    ``intra``: how the GPUs of a node talk (``"nvlink"`` or ``"pci"``); ``nvlinks``: NVLink links per
    GPU (for ``"nvlink"``); ``nic_gbps``: each NIC's line rate in Gbit/s; ``nics_per_node``;
    ``compute_capability``: 60 Pascal, 70 Volta, 80 Ampere, 90 Hopper, 100 Blackwell; ``cpu``:
    ``"intel"`` or ``"amd"`` (NCCL's network post overhead and LL caps depend on it); ``transport``:
    ``"rdma"`` (IB/RoCE verbs: the NIC's rate) or ``"tcp"`` (NCCL's socket transport, set up by
    ``socket``; module doc)."""

    gpus_per_node: int
    nodes: int = 1
    intra: Literal["nvlink", "pci"] = "pci"
    nvlinks: int = 0
    nic_gbps: float = 100.0
    nics_per_node: int = 1
    compute_capability: int = 70
    cpu: Literal["intel", "amd"] = "intel"
    transport: Literal["rdma", "tcp"] = "rdma"
    socket: Socket = field(default_factory=Socket)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"Cluster: gpus_per_node={self.gpus_per_node} and nodes={self.nodes} must be >= 1.")
        if self.intra not in ("nvlink", "pci"):
            raise ValueError(f"Cluster: intra={self.intra!r}; use 'nvlink' or 'pci' (NCCL's two intra-node link "
                             "classes).")
        if self.intra == "nvlink" and self.nvlinks < 1:
            raise ValueError("Cluster: intra='nvlink' needs nvlinks >= 1 (NVLink links per GPU, e.g. 6 on a "
                             "DGX-1 V100).")
        if self.nodes > 1 and not (self.nic_gbps > 0 and self.nics_per_node >= 1):
            raise ValueError(f"Cluster: {self.nodes} nodes need a network: nic_gbps={self.nic_gbps} must be > 0 and "
                             f"nics_per_node={self.nics_per_node} >= 1.")
        if self.cpu not in NET_OVERHEAD_US:
            raise ValueError(f"Cluster: cpu={self.cpu!r}; use 'intel' or 'amd'.")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Cluster: transport={self.transport!r}; use 'rdma' (InfiniBand/RoCE verbs) or 'tcp' "
                             "(NCCL's socket transport).")
        if not isinstance(self.socket, Socket):
            raise ValueError(f"Cluster: socket={self.socket!r} must be a gpucomm.tuning.transport.Socket.")

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_nodes(self, nodes: int) -> "Cluster":
        """The same machines, ``nodes`` of them."""
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class Graph:
    """What NCCL's topology search hands its tuning for one algorithm: channels and per-channel
    bandwidths (GB/s) inside a node and across nodes, the inter-node latency the network plugin
    reports (µs; 0 for NCCL's IB and socket transports), and whether intra-node links are NVLink."""

    channels: int
    bw_intra: float
    bw_inter: float
    nvlink: bool
    latency_inter_us: float = 0.0
    tree_pattern_penalty: bool = False  # NCCL_TOPO_PATTERN_TREE (one GPU carries all NIC traffic): x.85


def _nvlink_bw(cc: int) -> float:
    return next(bw for floor, bw in NVLINK_BW if cc >= floor) if cc >= 60 else 20.0


def _step_at_most(speeds: tuple[float, ...], limit: float) -> float:
    return next((s for s in speeds if s <= limit + 1e-9), speeds[-1])


def graph_for(cluster: Cluster, algorithm: str = "ring") -> Graph:
    """The channels and bandwidths NCCL's search finds for ``cluster`` in the plain cases (module doc)."""
    nvlink = cluster.intra == "nvlink"
    intra_total = cluster.nvlinks * _nvlink_bw(cluster.compute_capability) if nvlink else PCI_BW
    if cluster.nodes == 1:
        per = _nvlink_bw(cluster.compute_capability) if nvlink else PCI_BW
        channels = max(1, round(intra_total / per))
        return Graph(channels, per, per, nvlink)
    cc = cluster.compute_capability
    speeds = SPEEDS_INTER_SM100 if cc >= 100 else SPEEDS_INTER_SM90 if cc >= 90 else SPEEDS_INTER
    nic = cluster.nic_gbps * 1000.0 / 8000.0  # topo.cc: net.bw = mbps / 8000
    channels = cluster.nics_per_node
    bw = _step_at_most(speeds, min(nic, intra_total / channels))
    bw_intra = bw
    if algorithm == "tree" and cluster.nodes <= 2:  # search pass 2 raises a tree's bwIntra up to 2x bwInter
        bw_intra = _step_at_most(speeds, min(2 * bw, intra_total / channels))
    return Graph(channels, bw_intra, bw, nvlink)


@dataclass(frozen=True)
class NcclModel:
    """NCCL's predicted allreduce time on ``cluster`` (see the module doc). ``graphs`` overrides the
    derived ``graph_for(cluster, algorithm)`` per algorithm."""

    cluster: Cluster
    graphs: dict[str, Graph] = field(default_factory=dict)
    # (algorithm, protocol, actual) -> the size-free terms of ``time_us``: the planners ask for thousands of sizes
    _terms: dict[tuple[str, str, bool], tuple[float, float, int, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def graph(self, algorithm: str) -> Graph:
        """What NCCL's search hands its tuning (transport-blind)."""
        return self.graphs.get(algorithm) or graph_for(self.cluster, algorithm)

    def socket_gbs(self, algorithm: str) -> float:
        """The socket transport's limit on one network channel (GB/s); inf over RDMA or on one node."""
        c = self.cluster
        if c.transport != "tcp" or c.nodes == 1:
            return math.inf
        both = c.gpus_per_node == 1 or algorithm == "tree"  # one proxy sends and receives across the network
        per_gpu = math.ceil(self.graph(algorithm).channels / c.gpus_per_node)  # channels leave by different GPUs
        return c.socket.channel_gbs(per_gpu, both_directions=both)

    def actual_graph(self, algorithm: str) -> Graph:
        """The graph that runs: NCCL's, its network channels capped by the transport (module doc).
        A tree of two nodes keeps NCCL's 2x between its intra- and inter-node speeds."""
        g = self.graph(algorithm)
        cap = self.socket_gbs(algorithm)
        if cap == math.inf:
            return g
        intra_cap = 2 * cap if algorithm == "tree" and self.cluster.nodes <= 2 else cap
        return replace(g, bw_intra=min(g.bw_intra, intra_cap), bw_inter=min(g.bw_inter, cap))

    def _indices(self) -> tuple[int, int, int]:
        c = self.cluster
        cc = c.compute_capability
        cc_index = 3 if cc >= 100 else 2 if cc >= 90 else 1 if cc >= 80 else 0
        index2 = c.nodes - 1 if c.nodes <= 2 else 2
        index1 = cc_index if c.nodes == 1 else (1 if c.cpu == "amd" else 0)
        return cc_index, index1, index2

    def enabled(self, algorithm: str, protocol: str) -> bool:
        """LL128 runs only on Volta or newer over NVLink (and a NIC no farther than a PCIe switch);
        LL and Simple always."""
        if protocol != "LL128":
            return True
        return self.cluster.compute_capability >= 70 and self.graph(algorithm).nvlink

    def bandwidth_gbs(self, algorithm: str, protocol: str, graph: Graph | None = None) -> float:
        """The algorithm bandwidth NCCL assumes (GB/s), before the tree's per-size correction; on
        ``graph`` in place of ``self.graph(algorithm)`` when given."""
        c, g = self.cluster, graph or self.graph(algorithm)
        cc_index, index1, index2 = self._indices()
        n = c.ranks
        bw = g.bw_intra if c.nodes <= 2 else g.bw_inter
        bus = g.channels * bw
        if algorithm == "ring" and protocol == "LL":
            bus = min(LL_MAX_BW[index1][index2], bus * .5)
        if algorithm == "ring" and protocol == "LL128":
            bus = min(bus * 0.92, g.channels * PER_CH_MAX_RING_LL128_BW[cc_index][index2])
        if algorithm == "tree":
            bus = min(bus * .92, g.channels * PER_CH_MAX_TREE_BW[cc_index][index2])
            if protocol == "LL":
                bus = min(bus / 3.8, LL_MAX_BW[index1][index2])
            if protocol == "LL128":
                bus = min(bus * (7.0 / 9.0 if c.nodes == 1 else 120.0 / 128.0),
                          g.channels * PER_CH_MAX_TREE_LL128_BW[cc_index][index2])
            if g.tree_pattern_penalty:
                bus *= .85
        return bus * (n / (2 * (n - 1)) if algorithm == "ring" else .5)

    def latency_us(self, algorithm: str, protocol: str) -> float:
        """NCCL's latency of one allreduce (µs), before the ring's large-message plateau factor."""
        c, g = self.cluster, self.graph(algorithm)
        p = _P[protocol]
        n, nodes = c.ranks, c.nodes
        intra = HW_LATENCY_US["nvlink" if g.nvlink else "pci"][algorithm][p]
        ppn = n / nodes
        inter = HW_LATENCY_US["net"]["tree" if ppn == 1 else algorithm][p] + g.latency_inter_us
        if protocol == "Simple":
            inter += g.latency_inter_us  # the flush
        lat = BASE_LATENCY_US[algorithm][p]
        if algorithm == "ring":
            overhead = NET_OVERHEAD_US[c.cpu] * (3 if protocol == "Simple" else 1) if nodes > 1 else 0.0
            intra = max(intra, overhead)
            steps = 2 * (n - 1)
            inter_steps = 0 if nodes == 1 else 2 * (nodes - 1)
            return lat + (steps - inter_steps) * intra + inter_steps * inter
        return lat + 2 * ((n // nodes - 1) * intra + _log2i(nodes) * inter)

    def time_us(self, nbytes: int, algorithm: str, protocol: str, actual: bool = True) -> float:
        """ncclTopoGetAlgoTime for one allreduce of ``nbytes`` (µs); inf when disabled. ``actual``:
        on the graph that runs (``actual_graph``); else on NCCL's own, as NCCL predicts it."""
        if self.cluster.ranks <= 1:
            return 0.0
        if not self.enabled(algorithm, protocol):
            return math.inf
        terms = self._terms.get((algorithm, protocol, actual))
        if terms is None:  # what does not depend on the size, once per model
            bw = self.bandwidth_gbs(algorithm, protocol, self.actual_graph(algorithm) if actual else None)
            lat = self.latency_us(algorithm, protocol)
            plateau = (self.graph("ring").channels * self.cluster.ranks
                       if algorithm == "ring" and protocol == "Simple" and self.cluster.nodes > 1 else 0)
            factor = 1.9 if self.cluster.compute_capability < 80 else 1.4  # the ring's plateau effect
            terms = self._terms[(algorithm, protocol, actual)] = (bw, lat, plateau, factor)
        bw, lat, plateau, factor = terms
        log_size = _log2i(int(nbytes) >> 6)
        if algorithm == "tree" and 0 <= log_size < 23:
            bw *= TREE_CORRECTION[_P[protocol]][log_size]
        if plateau and nbytes // plateau >= 64:
            lat *= factor
        return lat + nbytes / (1000.0 * bw)

    def choice(self, nbytes: int, algorithm: str = "auto", protocol: str = "auto") -> tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL would pick: the fastest enabled combination by NCCL's
        own (transport-blind) times, or the fastest protocol of ``algorithm``, or exactly the pair
        asked for; the seconds are the pick's time on the graph that runs."""
        algos = ALGORITHMS if algorithm == "auto" else (algorithm,)
        protos = PROTOCOLS if protocol == "auto" else (protocol,)
        for name, allowed in (("algorithm", ALGORITHMS), ("protocol", PROTOCOLS)):
            bad = [v for v in (algos if name == "algorithm" else protos) if v not in allowed]
            if bad:
                raise ValueError(f"NcclModel: unknown {name} {bad[0]!r}; choose 'auto' or one of {', '.join(allowed)}.")
        best = min(((a, p, self.time_us(nbytes, a, p, actual=False)) for a in algos for p in protos),
                   key=lambda t: t[2])
        if not math.isfinite(best[2]):
            raise ValueError(f"NcclModel: {algorithm}/{protocol} is disabled on this cluster (LL128 needs Volta or "
                             "newer over NVLink); choose protocol='auto'.")
        return best[0], best[1], self.time_us(nbytes, best[0], best[1]) * 1e-6

    def time_s(self, nbytes: int, algorithm: str = "auto", protocol: str = "auto") -> float:
        """Seconds one allreduce of ``nbytes`` takes, by NCCL's model."""
        return self.choice(nbytes, algorithm, protocol)[2]

    def cost(self, algorithm: str = "auto", protocol: str = "auto"):
        """A ``cost(nbytes) -> seconds`` function for the step model."""
        return lambda nbytes: self.time_s(nbytes, algorithm, protocol)
