"""The settings of a job on Ray (Horovod's ``RayExecutor.create_settings`` and
``ElasticRayExecutor.create_settings``), and what they become in each worker's environment.

Ray starts the worker processes itself, so gpucomm over Ray needs no ssh: ``ssh_identity_file`` and
``ssh_str`` are accepted for Horovod scripts and change nothing (said once, never silently).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..runner.renamed import renamed
from ..settings import settings_problems

DEFAULT_TIMEOUT_S = 30.0  # Horovod's create_settings default
DEFAULT_PLACEMENT_GROUP_TIMEOUT_S = 100.0
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
NO_SSH = ("gpucomm.ray: {names} accepted, no effect: Ray starts the worker processes, so gpucomm over Ray uses no "
          "ssh (and writes no key file); leave {them} out.")


@dataclass
class RaySettings:
    """Settings of a fixed-size job (Horovod's ``MiniSettings``): ``timeout_s`` is how long the
    workers have to meet in ``hvd.init()`` (GPUCOMM_START_TIMEOUT), ``placement_group_timeout_s`` how
    long Ray may take to reserve their resources, ``nics`` the network interfaces for the job's
    traffic (the first also carries the store and Gloo)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    placement_group_timeout_s: float = DEFAULT_PLACEMENT_GROUP_TIMEOUT_S
    nics: tuple[str, ...] | None = None
    verbose: int = 1
    ssh_identity_file: str | None = None
    elastic: bool = False


@dataclass
class ElasticRaySettings(RaySettings):
    """Settings of an elastic job (Horovod's ``ElasticSettings``): between ``min_num_proc`` and
    ``max_num_proc`` workers; ``elastic_timeout`` bounds a wait for enough slots; ``reset_limit``
    bounds how often the job is re-formed; ``discovery`` finds hosts and slots (set by the executor
    unless ``override_discovery=False``)."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT_S
    discovery: Any = None
    elastic: bool = field(default=True)

    @property
    def num_proc(self) -> int:
        """Workers to start with (Horovod starts the job at ``min_num_proc``)."""
        return self.min_num_proc


def positive_seconds(name: str, value: Any) -> float:
    """``value`` as a finite number of seconds above zero, or a ValueError naming ``name``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"gpucomm.ray: {name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"gpucomm.ray: {name} must be a finite number of seconds above 0, got {value!r}")
    return seconds


def nic_list(nics: Iterable[str] | str | None) -> tuple[str, ...] | None:
    """Interface names from a set, list or comma-separated string (Horovod accepts a set)."""
    if nics is None:
        return None
    items = nics.split(",") if isinstance(nics, str) else list(nics)
    names = tuple(sorted({str(n).strip() for n in items if str(n).strip()}))
    return names or None


def warn_no_ssh(ssh_identity_file: str | None, ssh_str: str | None) -> None:
    """Say once that the ssh options change nothing on Ray."""
    given = [n for n, v in (("ssh_identity_file", ssh_identity_file), ("ssh_str", ssh_str)) if v]
    if given:
        warnings.warn(NO_SSH.format(names=" and ".join(given), them="them" if len(given) > 1 else "it"), stacklevel=3)


def create_settings(timeout_s: float = DEFAULT_TIMEOUT_S, ssh_identity_file: str | None = None,
                    ssh_str: str | None = None, placement_group_timeout_s: float = DEFAULT_PLACEMENT_GROUP_TIMEOUT_S,
                    nics: Iterable[str] | str | None = None) -> RaySettings:
    """Horovod's ``RayExecutor.create_settings`` (0.28.1 signature and defaults)."""
    warn_no_ssh(ssh_identity_file, ssh_str)
    return RaySettings(timeout_s=positive_seconds("timeout_s", timeout_s),
                       placement_group_timeout_s=positive_seconds("placement_group_timeout_s",
                                                                  placement_group_timeout_s),
                       nics=nic_list(nics), ssh_identity_file=ssh_identity_file)


ELASTIC_EXTRA = ("verbose",)


def create_elastic_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                            elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT_S, timeout_s: float = DEFAULT_TIMEOUT_S,
                            ssh_identity_file: str | None = None, nics: Iterable[str] | str | None = None,
                            min_np: int | None = None, max_np: int | None = None,
                            **kwargs: Any) -> ElasticRaySettings:
    """Horovod's ``ElasticRayExecutor.create_settings`` (0.28.1 signature and defaults, with its
    deprecated ``min_np``/``max_np``). Of Horovod's further settings only ``verbose`` applies on Ray;
    ``cooldown_range`` is refused (a failed slot stays out for the rest of the job)."""
    min_num_proc = renamed("min_np", min_np, "min_num_proc", min_num_proc)
    max_num_proc = renamed("max_np", max_np, "max_num_proc", max_num_proc)
    if kwargs.get("cooldown_range") is not None:
        raise ValueError("gpucomm.ray: cooldown_range is not offered: a worker slot that failed stays out of the job "
                         "for its rest (a node Ray loses leaves discovery by itself, and one that joins later is "
                         "used); leave cooldown_range out.")
    unknown = sorted(set(kwargs) - {"cooldown_range", *ELASTIC_EXTRA})
    if unknown:
        raise TypeError(f"gpucomm.ray: create_settings() got unexpected setting(s) {unknown}; on Ray it accepts "
                        f"min_num_proc, max_num_proc, reset_limit, elastic_timeout, timeout_s, ssh_identity_file, "
                        f"nics and verbose.")
    warn_no_ssh(ssh_identity_file, None)
    low = int(min_num_proc)
    if low < 1:
        raise ValueError(f"gpucomm.ray: min_num_proc must be at least 1, got {min_num_proc!r}")
    if max_num_proc is not None and int(max_num_proc) < low:
        raise ValueError(f"gpucomm.ray: max_num_proc {max_num_proc} is smaller than min_num_proc {low}")
    if reset_limit is not None and int(reset_limit) < 0:
        raise ValueError(f"gpucomm.ray: reset_limit must be 0 or more, got {reset_limit!r}")
    return ElasticRaySettings(
        timeout_s=positive_seconds("timeout_s", timeout_s), nics=nic_list(nics),
        verbose=int(kwargs.get("verbose", 0) or 0), ssh_identity_file=ssh_identity_file, min_num_proc=low,
        max_num_proc=None if max_num_proc is None else int(max_num_proc),
        reset_limit=None if reset_limit is None else int(reset_limit),
        elastic_timeout=positive_seconds("elastic_timeout", elastic_timeout))


def tunables(settings: RaySettings) -> dict[str, str]:
    """The settings as the variables the workers read (Horovod's names too)."""
    out = {"GPUCOMM_START_TIMEOUT": f"{settings.timeout_s:g}", "HOROVOD_START_TIMEOUT": f"{settings.timeout_s:g}"}
    if settings.nics:
        out["NCCL_SOCKET_IFNAME"] = ",".join(settings.nics)
        out["GPUCOMM_GLOO_IFACE"] = out["HOROVOD_GLOO_IFACE"] = settings.nics[0]
    return out


def check_worker_env(env: Mapping[str, str], where: str) -> None:
    """Refuse, before any worker starts, settings every worker would refuse at ``hvd.init()``."""
    problems = settings_problems(env)
    if problems:
        listed = " ".join(str(p) for p in problems)
        raise ValueError(f"gpucomm.ray: {where} hold(s) {len(problems)} refused setting(s): {listed} No worker was "
                         f"started.")


__all__ = ["ElasticRaySettings", "RaySettings", "check_worker_env", "create_elastic_settings", "create_settings",
           "nic_list", "positive_seconds", "tunables", "warn_no_ssh"]
