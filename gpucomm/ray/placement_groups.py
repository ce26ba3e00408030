"""How a fixed-size job's worker actors get their resources (Horovod's ``PGStrategy`` and
``ColocatedStrategy``): a placement group reserves them first, so that every worker starts or
none does, and the actors are created inside it.

* ``num_workers`` (or a current placement group the caller runs in): one bundle per worker,
  ``PACK``ed onto as few nodes as Ray can;
* ``num_hosts`` x ``num_workers_per_host``: one bundle per host, ``STRICT_SPREAD`` over distinct
  nodes, its workers inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, \
    remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class WorkerShape:
    """How many workers and what each one holds."""

    num_workers: int | None
    num_hosts: int | None
    num_workers_per_host: int
    cpus_per_worker: float
    gpus_per_worker: float  # 0 without use_gpu
    use_current_placement_group: bool

    @property
    def total(self) -> int:
        return self.num_workers if self.num_workers is not None else self.num_hosts * self.num_workers_per_host


def _resources(cpus: float, gpus: float) -> dict[str, float]:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v}


class WorkerPlacement:
    """Reserves the job's resources and creates its actors in them; ``release`` gives them back."""

    def __init__(self, shape: WorkerShape, timeout_s: float) -> None:
        self.shape = shape
        self.timeout_s = timeout_s
        self.group: PlacementGroup | None = None
        self.owned = False  # created here (so removed here), not the caller's current group

    def create_actors(self, actor_cls: Any) -> list[Any]:
        """The worker actors, in creation order, inside the reserved resources."""
        s = self.shape
        current = get_current_placement_group() if s.use_current_placement_group else None
        if current is not None or s.num_workers is not None:
            self.group = current or self._reserve([_resources(s.cpus_per_worker, s.gpus_per_worker)] * s.total,
                                                  "PACK")
            self.owned = current is None
            return [self._actor(actor_cls, -1 if current is not None else i) for i in range(s.total)]
        per_host = _resources(s.cpus_per_worker * s.num_workers_per_host, s.gpus_per_worker * s.num_workers_per_host)
        self.group = self._reserve([per_host] * s.num_hosts, "STRICT_SPREAD")
        self.owned = True
        return [self._actor(actor_cls, host) for host in range(s.num_hosts) for _ in range(s.num_workers_per_host)]

    def _actor(self, actor_cls: Any, bundle: int) -> Any:
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle,
                                                    placement_group_capture_child_tasks=False)
        return actor_cls.options(num_cpus=self.shape.cpus_per_worker, num_gpus=self.shape.gpus_per_worker,
                                 scheduling_strategy=strategy).remote()

    def _reserve(self, bundles: list[dict[str, float]], strategy: str) -> PlacementGroup:
        group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
        if not ready:
            remove_placement_group(group)
            how = (f"{len(bundles)} bundle(s) of {bundles[0]} on distinct nodes (STRICT_SPREAD: one per host)"
                   if strategy == "STRICT_SPREAD" else f"{len(bundles)} bundle(s) of {bundles[0]}")
            raise TimeoutError(
                f"gpucomm.ray: Ray could not reserve the job's resources within placement_group_timeout_s="
                f"{self.timeout_s:g} s: it asked for {how}; the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free now. Likely causes: fewer nodes, CPUs or GPUs than asked for "
                f"(num_hosts counts distinct nodes), or other actors still holding them. Fix: ask for less "
                f"(num_workers, cpus_per_worker, gpus_per_worker), shut down what holds them, or add nodes.")
        return group

    def release(self) -> None:
        """Remove the placement group this job created (never the caller's own)."""
        group, self.group = self.group, None
        if group is not None and self.owned:
            remove_placement_group(group)


__all__ = ["WorkerPlacement", "WorkerShape"]
