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
local ranks follow the workers' nodes. With GPUs, each worker's ``CUDA_VISIBLE_DEVICES`` is set here
(after Ray Train's own sharing, which sorts GPU ids as text and would put a two-GPU worker's neighbour
at its local rank): the node's GPUs, the worker's own at the index of its local rank, which is the GPU
gpucomm pins. Without GPUs it is set empty, so no worker pins a GPU Ray did not give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Set

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.constants import is_v2_enabled

from .layout import ActorInfo, cuda_visible_devices, placements
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
        # Ray makes one Backend per process (a singleton): one store per worker group it serves
        self.stores: dict[int, DriverStore] = {}

    def on_start(self, worker_group: Any, backend_config: GpucommConfig) -> None:
        settings = backend_config.settings()
        env = tunables(settings)
        check_worker_env(env, "GpucommConfig")
        self.close_store(worker_group)
        infos = [ActorInfo.from_dict(d) for d in worker_group.execute(describe_process)]  # by world rank
        devices = cuda_visible_devices(infos, use_gpu=any(info.gpu_ids for info in infos))
        store = self.stores[id(worker_group)] = DriverStore(settings.nics)
        ray.get([worker_group.execute_single_async(rank, set_env, {**env, **store.rank_env(slot),
                                                                   "CUDA_VISIBLE_DEVICES": visible})
                 for rank, (slot, visible) in enumerate(zip(placements(infos), devices))])

    def on_shutdown(self, worker_group: Any, backend_config: GpucommConfig) -> None:
        """The workers leave gpucomm's job first (else rank 0 would report the store lost), then the
        store closes, also when a worker is gone and Ray's call fails."""
        try:
            worker_group.execute(leave_job)
        finally:
            self.close_store(worker_group)

    def close_store(self, worker_group: Any) -> None:
        """Close the store served for ``worker_group``, if any."""
        store = self.stores.pop(id(worker_group), None)
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
