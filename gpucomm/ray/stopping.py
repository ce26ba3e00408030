"""Stopping a job's actors so that nothing is left running: each actor is asked to exit (its
process runs its exit handlers, so gpucomm leaves its job cleanly), then killed if it has not
within the grace period (one stuck in a collective cannot take the request), and the driver waits
until the processes on its own node are gone."""

from __future__ import annotations

import time
from typing import Any, Sequence

import psutil
import ray
from ray.exceptions import RayError

from ..bootstrap.netaddr import local_addresses

STOP_GRACE_S = 5.0
EXIT_WAIT_S = 15.0


def stop_actors(actors: Sequence[Any], processes: Sequence[tuple[str, int]], *, graceful: bool = True,
                grace: float = STOP_GRACE_S) -> list[int]:
    """Stop ``actors``; returns the pids among ``processes`` (``(node ip, pid)``) on this node that
    are still alive after ``EXIT_WAIT_S`` (none, normally)."""
    if graceful and actors:
        asked = []
        for actor in actors:
            try:
                asked.append(actor.__ray_terminate__.remote())
            except RayError:
                pass
        if asked:
            ray.wait(asked, num_returns=len(asked), timeout=grace)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except (RayError, ValueError):
            pass
    here = local_addresses() | {"127.0.0.1"}
    mine = [pid for ip, pid in processes if ip in here]
    deadline = time.monotonic() + EXIT_WAIT_S
    alive = [pid for pid in mine if _running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _running(pid)]
    return alive


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


__all__ = ["STOP_GRACE_S", "stop_actors"]
