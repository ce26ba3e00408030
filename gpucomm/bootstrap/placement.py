"""Where one rank sits in a job: the one record of it, shared by the launcher (which places the
ranks), the elastic rounds (which re-place them) and ``World`` (which reads a rank's own place back
from its environment), and the environment variables that carry it to the rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One rank's place: its host, its rank among ``size``, its rank among the ``local_size`` ranks
    of its host, and its cross rank among the ``cross_size`` hosts that have a rank with its local
    rank (Horovod's definitions; None where a launcher does not say)."""

    host: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int | None
    cross_size: int | None


def placement_env(placement: Placement) -> dict[str, str]:
    """The variables that place one rank (``gpucomm.bootstrap.world`` reads them back), under
    gpucomm's and Horovod's names."""
    env = {}
    for prefix in ("GPUCOMM", "HOROVOD"):
        env.update({f"{prefix}_RANK": str(placement.rank), f"{prefix}_SIZE": str(placement.size),
                    f"{prefix}_LOCAL_RANK": str(placement.local_rank),
                    f"{prefix}_LOCAL_SIZE": str(placement.local_size),
                    f"{prefix}_CROSS_RANK": str(placement.cross_rank),
                    f"{prefix}_CROSS_SIZE": str(placement.cross_size), f"{prefix}_HOSTNAME": placement.host})
    return env


PLACEMENT_VARS = tuple(placement_env(Placement("", 0, 1, 0, 1, 0, 1)))  # every variable placement_env sets


def place(workers: list[tuple[str, str]]) -> dict[str, Placement]:
    """Placements for ``workers`` (``(worker id, host)`` in rank order): local rank counts within a
    host, cross rank counts hosts among the ranks with the same local rank (Horovod's definitions)."""
    hosts: dict[str, list[str]] = {}
    for worker, host in workers:
        hosts.setdefault(host, []).append(worker)
    out: dict[str, Placement] = {}
    for rank, (worker, host) in enumerate(workers):
        local = hosts[host].index(worker)
        peers = [h for h, ws in hosts.items() if len(ws) > local]
        out[worker] = Placement(host, rank, len(workers), local, len(hosts[host]), peers.index(host), len(peers))
    return out


__all__ = ["PLACEMENT_VARS", "Placement", "place", "placement_env"]
