"""Ranks from where Ray really placed the actors: pure functions, no Ray.

Workers are ordered by their node's IP address (numerically), then by the order they were
created, so the ranks of one node are contiguous and local rank 0 of every node is its first
worker (Horovod's rule, and Ray Train's). A node is named by its IP address: gpucomm tells ranks
on one host from ranks on others by that name. With GPUs, every worker of a node sees the GPUs
Ray gave that node's workers (``CUDA_VISIBLE_DEVICES``, as Horovod sets it), ordered so that the
GPU at index ``local_rank`` is the worker's own: gpucomm pins a rank to that index.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..bootstrap.placement import Placement, place


@dataclass(frozen=True)
class ActorInfo:
    """Where Ray placed one worker actor (``BaseGpucommWorker.describe``)."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ActorInfo":
        return cls(str(d["node_id"]), str(d["node_ip"]), str(d["hostname"]), int(d["pid"]),
                   tuple(str(g) for g in d.get("gpu_ids", ())))


def _ip_key(ip: str) -> tuple:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (2, ip)
    return (address.version, int(address))


def rank_order(infos: Sequence[ActorInfo]) -> list[int]:
    """Indices of ``infos`` (in creation order) in rank order: by node IP, then creation order."""
    return sorted(range(len(infos)), key=lambda i: (_ip_key(infos[i].node_ip), i))


def placements(ranked: Sequence[ActorInfo]) -> list[Placement]:
    """Each worker's place (rank, local and cross rank) for workers already in rank order."""
    by_worker = place([(str(i), info.node_ip) for i, info in enumerate(ranked)])
    return [by_worker[str(i)] for i in range(len(ranked))]


def visible_devices(ranked: Sequence[ActorInfo]) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each worker (rank order): its node's GPUs, each worker's first GPU
    at the index of its local rank, then the workers' further GPUs; None for a worker with no GPU."""
    nodes: dict[str, list[ActorInfo]] = {}
    for info in ranked:
        nodes.setdefault(info.node_ip, []).append(info)
    listing: dict[str, str] = {}
    for ip, infos in nodes.items():
        firsts = [info.gpu_ids[0] for info in infos if info.gpu_ids]
        rest = [g for info in infos for g in info.gpu_ids[1:]]
        listing[ip] = ",".join(dict.fromkeys(firsts + rest))
    return [listing[info.node_ip] if info.gpu_ids else None for info in ranked]


def cuda_visible_devices(ranked: Sequence[ActorInfo], use_gpu: bool, *, own_only: bool = False) -> list[str]:
    """What each worker (rank order) must set ``CUDA_VISIBLE_DEVICES`` to before CUDA starts in it:

    - ``use_gpu`` off: ``""``. Ray leaves a zero-GPU actor's variable alone, and gpucomm would
      otherwise pin GPUs that Ray gave to nobody (or to other work);
    - ``own_only`` (elastic jobs, whose local ranks change from round to round): the worker's first
      GPU alone, so that gpucomm pins it at every round, whatever the local rank;
    - else ``visible_devices``: the node's GPUs, the worker's own at the index of its local rank
      (Ray's own shared listing sorts ids as text, "10" before "2", and a worker with two GPUs
      would find its neighbour's at its local rank)."""
    if not use_gpu:
        return [""] * len(ranked)
    if own_only:
        return [info.gpu_ids[0] if info.gpu_ids else "" for info in ranked]
    return [visible if visible is not None else "" for visible in visible_devices(ranked)]


def check_distinct_gpus(ranked: Sequence[ActorInfo]) -> None:
    """Two workers of one node given the same GPU would both pin it: refuse before training starts."""
    seen: dict[tuple[str, str], int] = {}
    for rank, info in enumerate(ranked):
        for gpu in info.gpu_ids:
            other = seen.setdefault((info.node_ip, gpu), rank)
            if other != rank:
                raise RuntimeError(f"gpucomm.ray: ranks {other} and {rank} on node {info.node_ip} were both given GPU "
                                   f"{gpu} by Ray, so both would train on it. Likely cause: fractional "
                                   f"gpus_per_worker; give each worker whole GPUs (gpus_per_worker >= 1).")


__all__ = ["ActorInfo", "check_distinct_gpus", "cuda_visible_devices", "placements", "rank_order", "visible_devices"]
