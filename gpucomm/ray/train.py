"""Ray Train with gpucomm: a backend for Ray's data-parallel trainer, and ``GpucommTrainer``,
which has the signature of Ray's removed ``HorovodTrainer``.

    def train_loop_per_worker(config):
        import gpucomm.torch as hvd
        hvd.init()
        optimizer = hvd.DistributedOptimizer(...)
        ...
        ray.train.report({"loss": loss})

    GpucommTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=4)).fit()

The backend plugs in where Ray's own backends do (``BackendConfig.backend_cls``; Train V2's
``DataParallelTrainer`` calls its ``on_start`` once the worker group is up, and ``on_shutdown``
before it stops it; Train V1's, with ``RAY_TRAIN_V2_ENABLED=0``, does the same). ``on_start``
serves the job's rendezvous store from the process that runs it (Train V2's controller actor) and
gives each worker the environment that places it: gpucomm's rank is Ray Train's world rank, and
local ranks follow the workers' nodes. Ray Train shares a node's GPUs among its workers
(``share_cuda_visible_devices``), ordered by GPU id like the local ranks, so gpucomm's local-rank
pinning picks each worker's own GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Set

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.constants import is_v2_enabled

from .layout import ActorInfo, placements
from .settings import check_worker_env, nic_list, positive_seconds, RaySettings, tunables
from .store import DriverStore
from .worker import describe_process, leave_job, set_env

if is_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:
    from ray.train.data_parallel_trainer import DataParallelTrainer


@dataclass
class GpucommConfig(BackendConfig):
    """gpucomm's settings for Ray Train (the part of Ray's ``HorovodConfig`` that applies):
    ``timeout_s`` for the workers to meet in ``hvd.init()``, ``nics`` for the job's traffic (the
    first also carries the store and Gloo); ``verbose`` as Horovod's."""

    nics: Optional[Set[str]] = None
    timeout_s: float = 300
    verbose: int = 1

    @property
    def backend_cls(self) -> type:
        return GpucommBackend

    def settings(self) -> RaySettings:
        return RaySettings(timeout_s=positive_seconds("timeout_s", self.timeout_s), nics=nic_list(self.nics),
                           verbose=self.verbose)


class GpucommBackend(Backend):
    """Sets gpucomm's job up across a Ray Train worker group (see the module's docstring)."""

    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        self.store: DriverStore | None = None

    def on_start(self, worker_group: Any, backend_config: GpucommConfig) -> None:
        settings = backend_config.settings()
        env = tunables(settings)
        check_worker_env(env, "GpucommConfig")
        self.close_store()
        infos = [ActorInfo.from_dict(d) for d in worker_group.execute(describe_process)]  # by world rank
        self.store = DriverStore(settings.nics)
        ray.get([worker_group.execute_single_async(rank, set_env, {**env, **self.store.rank_env(slot)})
                 for rank, slot in enumerate(placements(infos))])

    def on_shutdown(self, worker_group: Any, backend_config: GpucommConfig) -> None:
        """The workers leave gpucomm's job first (else rank 0 would report the store lost), then the
        store closes, also when a worker is gone and Ray's call fails."""
        try:
            worker_group.execute(leave_job)
        finally:
            self.close_store()

    def close_store(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()


class GpucommTrainer(DataParallelTrainer):
    """Ray's data-parallel trainer with gpucomm's backend (Ray's ``HorovodTrainer`` signature, with
    ``gpucomm_config`` for ``horovod_config``)."""

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, train_loop_config: dict | None = None,
                 gpucomm_config: GpucommConfig | None = None, scaling_config: Any = None, dataset_config: Any = None,
                 run_config: Any = None, datasets: dict | None = None, metadata: dict | None = None,
                 resume_from_checkpoint: Any = None) -> None:
        super().__init__(train_loop_per_worker, train_loop_config=train_loop_config,
                         backend_config=gpucomm_config or GpucommConfig(), scaling_config=scaling_config,
                         dataset_config=dataset_config, run_config=run_config, datasets=datasets, metadata=metadata,
                         resume_from_checkpoint=resume_from_checkpoint)


__all__ = ["GpucommBackend", "GpucommConfig", "GpucommTrainer"]
