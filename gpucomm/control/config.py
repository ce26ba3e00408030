"""The control plane's settings and the small types it shares with the job that builds it."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from ..dataplane.inline import DEFAULT_INLINE_BYTES
from ..settings import (CACHE_CAPACITY, CYCLE_TIME_MS, DEADLOCK_CHECK, DEFAULT_LIVENESS_S, INLINE_BYTES, MAX_SPIN_US,
                        SPIN_US, STALL_CHECK_DISABLE, STALL_CHECK_SECONDS, STALL_SHUTDOWN_SECONDS, liveness_seconds)
from .coordinator import DEFAULT_CACHE_CAPACITY


# us a caller blocked on a control round polls before sleeping: the coordinator's answer to a small
# synchronous op arrives within ~100-250 us of the request on one host (benchmarks/overhead.py)
DEFAULT_SPIN_US = 250.0


def _usable_cores() -> int:
    """Cores this process may run on: its affinity mask (cpusets, taskset), else all of them, and no
    more than a cgroup v2 CPU quota allows (``cpu.max``, e.g. a container's ``--cpus``). A rank
    pinned to one core (``mpirun --bind-to core``, Slurm ``--cpu-bind``) counts 1: such ranks poll
    only when ``GPUCOMM_SPIN_US`` asks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(float(quota) / float(period))))
    except (OSError, ValueError):
        pass
    return cores


class Send(str, enum.Enum):
    """When a submitted request leaves for the coordinator."""

    CYCLE = "cycle"  # after at most ``cycle_time``; requests submitted meanwhile share the frame
    NOW = "now"  # at once (work that should start while the caller keeps computing)
    ON_WAIT = "on_wait"  # when the caller waits on it, which it is about to do


class ControlLinks(NamedTuple):
    """The control connections: a worker's channel to rank 0, or rank 0's channels to the others;
    ``hosts[r]`` is the host rank ``r`` runs on, so that a rank that falls silent is named with it."""

    to_root: Any = None
    workers: Mapping[int, Any] = {}
    hosts: tuple[str, ...] = ()

    def where(self, rank: int) -> str:
        """`` on HOST`` for ``rank`` when its host is known, else nothing."""
        return f" on {self.hosts[rank]}" if 0 <= rank < len(self.hosts) else ""


@dataclass(frozen=True)
class ControlConfig:
    """Tunables of the control plane (``from_env`` reads GPUCOMM_* and Horovod's names)."""

    timeout: float = 300.0
    cycle_time: float = 0.001  # seconds a request submitted without a wait may sit before it is sent
    cache_capacity: int = DEFAULT_CACHE_CAPACITY
    stall_warning: float | None = 60.0  # None: the stall inspector is off
    stall_shutdown: float | None = None  # None: stalls only warn
    inline_bytes: int = DEFAULT_INLINE_BYTES  # CPU allreduces up to this size are reduced by the coordinator
    liveness_timeout: float | None = DEFAULT_LIVENESS_S  # s of control-channel silence before a rank is declared gone
    deadlock_check: bool = True  # error when every member of a set is blocked on operations that lack another
    spin: float = 0.0  # s a caller blocked on a control round polls its sockets before it sleeps (see below)

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeout: float, local_size: int | None = None) -> "ControlConfig":
        """``local_size``: ranks on this host; polling is on by default only while they are no more
        than the cores this process may use (an oversubscribed host needs the core a poller would
        take for the rank it waits on). None (not known): off unless ``GPUCOMM_SPIN_US`` says."""
        cycle_ms = CYCLE_TIME_MS.read(env, 1.0)
        capacity = CACHE_CAPACITY.read(env, DEFAULT_CACHE_CAPACITY)
        disabled = STALL_CHECK_DISABLE.read(env, False)
        warning = STALL_CHECK_SECONDS.read(env, 60.0)
        shutdown = STALL_SHUTDOWN_SECONDS.read(env, 0.0)
        if shutdown and not disabled and shutdown <= warning:
            raise ValueError(f"the stall shutdown time ({shutdown:g} s) must exceed the stall warning time "
                             f"({warning:g} s): a stall is reported first, then turned into an error. Raise "
                             f"GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS or lower GPUCOMM_STALL_CHECK_TIME_SECONDS.")
        inline = INLINE_BYTES.read(env, DEFAULT_INLINE_BYTES)
        # by default well inside the collective timeout, so a stopped rank is named before a transfer times out
        liveness = liveness_seconds(env, timeout)
        default_spin = DEFAULT_SPIN_US if local_size is not None and local_size <= _usable_cores() else 0.0
        spin_us = SPIN_US.read(env, default_spin)  # at most MAX_SPIN_US: longer burns a core per slower rank
        return cls(timeout=timeout, spin=spin_us / 1e6, cycle_time=cycle_ms / 1000.0, cache_capacity=capacity,
                   stall_warning=None if disabled else warning, stall_shutdown=(shutdown or None) if not disabled else None,
                   inline_bytes=inline, liveness_timeout=liveness or None,
                   deadlock_check=DEADLOCK_CHECK.read(env, True))


__all__ = ["ControlConfig", "ControlLinks", "DEFAULT_CACHE_CAPACITY", "DEFAULT_SPIN_US", "MAX_SPIN_US", "Send"]
