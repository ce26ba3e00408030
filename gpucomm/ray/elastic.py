"""``ElasticRayExecutor``: Horovod's elastic executor on Ray for gpucomm (0.28.1's API).

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, verbose=True)
    executor = ElasticRayExecutor(settings, use_gpu=True, cpus_per_slot=2)
    executor.start()
    results = executor.run(train_fn)    # train_fn: hvd.init(); ... @hvd.elastic.run def train(state)

The job's slots come from the Ray cluster (``discovery.py``), or from ``settings.discovery`` with
``override_discovery=False``; the rounds are gpucomm's (``elastic_driver.py``). ``run`` returns the
values of the workers of the final round, by rank, and raises ``ElasticJobError`` (a
RuntimeError, as Horovod raises) naming the cause when the job cannot go on. Each ``run`` needs a
``start`` before it: the job's store lives from ``start`` to the end of ``run``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..runner.round_policy import ElasticLimits
from .discovery import RayHostDiscovery
from .elastic_driver import ActorShape, ElasticRayDriver
from .executor import check_driver, check_gpus
from .ray_logger import LogPump
from .settings import ElasticRaySettings, check_worker_env, create_elastic_settings, tunables
from .store import DriverStore
from .worker import CallWith


class ElasticRayExecutor:
    """An elastic gpucomm job on the Ray cluster (Horovod's ``ElasticRayExecutor``): every slot of
    ``cpus_per_slot`` CPUs (and ``gpus_per_slot`` GPUs with ``use_gpu``) may hold a worker, between
    the settings' ``min_num_proc`` and ``max_num_proc``; ``env_vars`` are set in every worker."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: float = 600, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics: Any = None, min_np: int | None = None, max_np: int | None = None,
                        **kwargs: Any) -> ElasticRaySettings:
        """Horovod's elastic settings; of its further keywords ``verbose`` applies."""
        return create_elastic_settings(min_num_proc, max_num_proc, reset_limit, elastic_timeout, timeout_s,
                                       ssh_identity_file, nics, min_np, max_np, **kwargs)

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float | None = None, env_vars: dict[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
        if not isinstance(settings, ElasticRaySettings):
            raise TypeError(f"gpucomm.ray: settings must come from ElasticRayExecutor.create_settings(), got "
                            f"{type(settings).__name__}")
        gpus = check_gpus(use_gpu, gpus_per_slot, "gpus_per_slot")
        if not isinstance(cpus_per_slot, (int, float)) or cpus_per_slot <= 0:
            raise ValueError(f"gpucomm.ray: cpus_per_slot must be a number above 0, got {cpus_per_slot!r}")
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot,
                                                  gpus_per_slot=gpus or 1)
        elif not callable(getattr(settings.discovery, "find_available_hosts_and_slots", None)):
            raise ValueError("gpucomm.ray: override_discovery=False needs settings.discovery: an object whose "
                             "find_available_hosts_and_slots() returns {node ip: slots}.")
        self.settings = settings
        self.use_gpu = bool(use_gpu)
        self.cpus_per_slot = float(cpus_per_slot)
        self.gpus_per_slot = gpus
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self._store: DriverStore | None = None
        self._env: dict[str, str] = {}
        self.leftover_pids: list[int] = []  # worker processes on this node still alive after the last run

    def start(self) -> None:
        """Open the job's store and check the settings (the workers start with ``run``)."""
        if self._store is not None:
            raise RuntimeError("gpucomm.ray: start() was already called; call run() next.")
        check_driver()
        env = {**tunables(self.settings), **self.env_vars}
        check_worker_env(env, "env_vars and the settings")
        self._store = DriverStore(self.settings.nics)
        self._env = env

    def run(self, worker_fn: Callable[[], Any], callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` elastically on the workers; the final round's values by rank.
        ``callbacks`` receive every value the workers log with ``gpucomm.ray.ray_logger.log``."""
        if self._store is None:
            raise RuntimeError("gpucomm.ray: call start() before run() (each run() needs its own start()).")
        store, self._store = self._store, None
        s = self.settings
        limits = ElasticLimits(s.min_num_proc, s.max_num_proc, s.elastic_timeout, s.reset_limit)
        driver = ElasticRayDriver(s.discovery, limits, store, LogPump(store),
                                  shape=ActorShape(self.cpus_per_slot, self.gpus_per_slot), env=self._env,
                                  start_timeout=s.timeout_s, verbose=bool(s.verbose))
        try:
            return driver.run(CallWith(worker_fn), callbacks)
        finally:
            self.leftover_pids = driver.leftover_pids
            store.close()


__all__ = ["ElasticRayExecutor"]
