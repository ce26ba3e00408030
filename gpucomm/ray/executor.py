"""``RayExecutor``: Horovod's ``horovod.ray.RayExecutor`` for gpucomm (0.28.1's API).

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, use_gpu=True)
    executor.start()
    losses = executor.run(train, args=(0.1,))     # train calls hvd.init() itself; results by rank
    executor.shutdown()

``start`` reserves the workers' resources in a placement group, starts one actor per worker,
ranks them by where Ray placed them (node IP, then creation order), and gives each the
environment that places it in the job; the driver serves the job's rendezvous store, as
``gpucomm-run`` does. Functions run inside the actors (Ray pickles them). With ``min_workers`` the
executor runs elastic jobs instead (``elastic.py``'s driver), as Horovod's does.

Where Horovod hangs or says little, this raises: a worker that dies or raises ends ``run`` at once
with a ``RunError`` naming its rank, node and process (Horovod's ``ray.get`` waits for all, and
the survivors wait in a collective); a call after such a loss, before ``start`` or after
``shutdown`` says what to do.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import ray

from ..errors import RunError
from ..runner.round_policy import ElasticLimits
from .discovery import RayHostDiscovery
from .elastic_driver import ActorShape, ElasticRayDriver
from .layout import ActorInfo, check_distinct_gpus, cuda_visible_devices, placements, rank_order
from .outcomes import failure_error, gather
from .placement_groups import WorkerPlacement, WorkerShape
from .ray_logger import LogPump
from .settings import RaySettings, check_worker_env, create_settings, tunables
from .stopping import stop_actors
from .store import DriverStore
from .worker import BaseGpucommWorker, CallWith


def check_gpus(use_gpu: bool, gpus: float | None, name: str) -> float:
    """Horovod's rules for the GPUs of a worker: only with use_gpu, at least one; default 1 with use_gpu."""
    if gpus and not use_gpu:
        raise ValueError(f"{name} is set, but use_gpu is False. use_gpu must be True if {name} is set.")
    if use_gpu and gpus is not None and gpus < 1:
        raise ValueError(f"{name} must be >= 1: Got {gpus}.")
    return float(gpus or int(use_gpu))


def _positive(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"gpucomm.ray: {name} must be a number above 0, got {value!r}")


def check_driver() -> None:
    """gpucomm's store is served by the driver, so the driver must run on the cluster."""
    client = getattr(getattr(ray.util, "client", None), "ray", None)
    if client is not None and client.is_connected():
        raise RuntimeError("gpucomm.ray: this driver is connected through Ray Client (ray://), but the job's store is "
                           "served by the driver and the workers could not reach it here. Run the driver on the "
                           "cluster instead: `ray job submit -- python train.py`, or from a node of the cluster.")


class RayExecutor:
    """A job of gpucomm workers on Ray (Horovod's ``RayExecutor``); see the module's docstring.

    ``num_workers`` workers with ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs with
    ``use_gpu``), or ``num_hosts`` x ``num_workers_per_host`` spread over distinct nodes; a current
    placement group (``use_current_placement_group``) is used when the caller runs in one. With
    ``min_workers`` (and optionally ``max_workers``, ``reset_limit``, ``elastic_timeout``), an
    elastic job: ``run``/``execute`` run elastically, ``run_remote``/``execute_single`` are refused
    (the workers are ephemeral), as in Horovod."""

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: float = 100, nics: Any = None) -> RaySettings:
        """Horovod's settings: ``timeout_s`` for the workers to meet in ``hvd.init()``,
        ``placement_group_timeout_s`` for Ray to reserve their resources, ``nics`` for the job's
        traffic; the ssh options are accepted and change nothing on Ray."""
        return create_settings(timeout_s, ssh_identity_file, ssh_str, placement_group_timeout_s, nics)

    def __init__(self, settings: RaySettings, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: Sequence[int] | None = None, elastic_timeout: float = 600,
                 override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`. Elastic workloads require a "
                             "positive `min_workers`.")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided. Only one of the above is allowed as "
                             "workloads cannot be elastic and non-elastic.")
        if not isinstance(settings, RaySettings):
            raise TypeError(f"gpucomm.ray: settings must come from RayExecutor.create_settings(), got "
                            f"{type(settings).__name__}")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host), ("cpus_per_worker", cpus_per_worker),
                            ("min_workers", min_workers), ("max_workers", max_workers),
                            ("elastic_timeout", elastic_timeout)):
            _positive(name, value)
        gpus = check_gpus(use_gpu, gpus_per_worker, "gpus_per_worker")
        self.settings = settings
        self.elastic = min_workers is not None
        self.settings.elastic = self.elastic
        if self.elastic:
            if cooldown_range is not None:
                raise ValueError("gpucomm.ray: cooldown_range is not offered: a worker slot that failed stays out of "
                                 "the job for its rest; leave cooldown_range out.")
            if not override_discovery:
                raise ValueError("gpucomm.ray: override_discovery=False needs a discovery of your own, which "
                                 "RayExecutor has no setting for; use ElasticRayExecutor with settings.discovery set.")
            self._limits = ElasticLimits(int(min_workers), None if max_workers is None else int(max_workers),
                                         float(elastic_timeout), reset_limit)
            if self._limits.max_np is not None and self._limits.max_np < self._limits.min_np:
                raise ValueError(f"gpucomm.ray: max_workers {max_workers} is smaller than min_workers {min_workers}")
        elif num_workers is None and num_hosts is None:
            raise ValueError("gpucomm.ray: give num_workers (workers packed onto as few nodes as possible) or "
                             "num_hosts with num_workers_per_host (workers spread evenly over distinct nodes).")
        elif num_workers is not None and num_hosts is not None:
            raise ValueError("gpucomm.ray: give num_workers or num_hosts, not both.")
        self._shape = WorkerShape(None if num_workers is None else int(num_workers),
                                  None if num_hosts is None else int(num_hosts), int(num_workers_per_host),
                                  float(cpus_per_worker), gpus, bool(use_current_placement_group))
        self._use_gpu = bool(use_gpu)
        self._store: DriverStore | None = None
        self._placement: WorkerPlacement | None = None
        self._pump: LogPump | None = None
        self.workers: list[Any] = []  # actor handles, in rank order
        self._infos: list[ActorInfo] = []
        self._executable: tuple[type | None, Sequence[Any], dict[str, Any]] = (None, (), {})
        self._env: dict[str, str] = {}
        self._broken: str | None = None
        self.leftover_pids: list[int] = []  # worker processes on this node still alive after shutdown()

    # ------------------------------------------------------------------ start

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None, extra_env_vars: dict[str, Any] | None = None) -> None:
        """Start the workers: ``executable_cls(*executable_args, **executable_kwargs)`` is created in
        each (after its environment is set; ``execute`` passes it to functions), and
        ``extra_env_vars`` are set in every worker (the job's own variables take precedence)."""
        if self._store is not None:
            raise RuntimeError("gpucomm.ray: start() was already called; call shutdown() before starting again.")
        check_driver()
        env = {**tunables(self.settings), **{str(k): str(v) for k, v in (extra_env_vars or {}).items()}}
        check_worker_env(env, "extra_env_vars and the settings")
        self._executable = (executable_cls, list(executable_args or ()), dict(executable_kwargs or {}))
        self._store = DriverStore(self.settings.nics)
        self._pump = LogPump(self._store)
        self._env = env
        if self.elastic:
            return  # the workers start with each elastic run
        try:
            self._start_workers()
        except BaseException:
            self._release()
            raise

    def _start_workers(self) -> None:
        self._placement = WorkerPlacement(self._shape, self.settings.placement_group_timeout_s)
        actors = self._placement.create_actors(ray.remote(BaseGpucommWorker))
        self.workers = actors
        try:
            found = ray.get([a.describe.remote() for a in actors], timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"gpucomm.ray: the {len(actors)} worker actors did not start within "
                               f"placement_group_timeout_s={self.settings.placement_group_timeout_s:g} s although "
                               f"their resources were reserved; the Ray worker logs (/tmp/ray/session_latest/logs) "
                               f"say why (an import failing, a node in trouble).") from None
        infos = [ActorInfo.from_dict(d) for d in found]
        order = rank_order(infos)
        self.workers = [actors[i] for i in order]
        self._infos = [infos[i] for i in order]
        check_distinct_gpus(self._infos)
        devices = cuda_visible_devices(self._infos, self._use_gpu)
        cls, args, kwargs = self._executable
        ready = []
        for worker, slot, visible in zip(self.workers, placements(self._infos), devices):
            env = {**self._env, **self._store.rank_env(slot), "CUDA_VISIBLE_DEVICES": visible}
            ready.append(worker.prepare.remote(env, cls, args, kwargs))
        outcome = gather(ready)
        if outcome.failures:
            raise failure_error(outcome, self._where(), "start (executable_cls)")

    # ------------------------------------------------------------------ calls

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None, kwargs: dict[str, Any] | None = None,
            callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results by rank. ``callbacks`` receive every
        value the workers log with ``gpucomm.ray.ray_logger.log`` while it runs."""
        call = CallWith(fn, tuple(args or ()), dict(kwargs or {}))
        if self.elastic:
            return self._run_elastic(call, callbacks)
        return self._on_all(call, callbacks, "function")

    def execute(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """``fn(executable)`` on every worker (the ``executable_cls`` instance, or None); results by rank."""
        if self.elastic:
            return self._run_elastic(fn, callbacks)
        return self._on_all(fn, callbacks, "function")

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker, without waiting: Ray object refs by rank
        (``ray.get`` them; failures then surface as Ray's own errors)."""
        if self.elastic:
            raise NotImplementedError("ObjectRefs cannot be returned from elastic runs as the workers are ephemeral; "
                                      "use run() instead.")
        self._check_started("run_remote")
        call = CallWith(fn, tuple(args or ()), dict(kwargs or {}))
        return [w.execute.remote(call) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only; its result."""
        if self.elastic:
            raise NotImplementedError("Elastic mode does not support execute_single; use execute() instead.")
        self._check_started("execute_single")
        outcome = gather([self.workers[0].execute.remote(fn)], self._poll(None))
        self._pump.poll(None, final=not outcome.unfinished)
        if outcome.failures:
            self._note_loss(outcome)
            raise failure_error(outcome, self._where()[:1], "function", size=len(self.workers))
        return outcome.results[0]

    def _on_all(self, fn: Callable[[Any], Any], callbacks, what: str) -> list[Any]:
        self._check_started("run" if isinstance(fn, CallWith) else "execute")
        outcome = gather([w.execute.remote(fn) for w in self.workers], self._poll(callbacks))
        self._pump.poll(callbacks, final=not outcome.unfinished)
        if outcome.failures:
            self._note_loss(outcome)
            raise failure_error(outcome, self._where(), what)
        return outcome.results

    def _run_elastic(self, fn: Callable[[Any], Any], callbacks) -> list[Any]:
        if self._store is None:
            raise RuntimeError("gpucomm.ray: call start() before run()/execute() (and after shutdown(), start() "
                               "again).")
        discovery = RayHostDiscovery(self._use_gpu, self._shape.cpus_per_worker, self._shape.gpus_per_worker or 1)
        # each elastic run is a job of its own: its own store and run id, or a second run would meet the first's
        # rounds (its round 1's arrivals, its 'job ended' verdict) under the same keys
        store = DriverStore(self.settings.nics)
        driver = None
        try:
            driver = ElasticRayDriver(discovery, self._limits, store, LogPump(store),
                                      shape=ActorShape(self._shape.cpus_per_worker, self._shape.gpus_per_worker),
                                      env=self._env, start_timeout=self.settings.timeout_s,
                                      executable=self._executable, verbose=self.settings.verbose >= 2)
            return driver.run(fn, callbacks)
        finally:
            if driver is not None:
                self.leftover_pids = driver.leftover_pids
            store.close()

    def _poll(self, callbacks) -> Callable[[], None]:
        return lambda: self._pump.poll(callbacks)

    def _note_loss(self, outcome) -> None:
        """A worker that died or is still stuck leaves the job unusable for further calls."""
        if outcome.unfinished or any(f.died for f in outcome.failures):
            cause = outcome.cause
            self._broken = f"rank {cause.index} {'died' if cause.died else 'failed'} in an earlier call"

    def _check_started(self, what: str) -> None:
        if self._store is None or not self.workers:
            raise RuntimeError(f"gpucomm.ray: {what}() needs the workers: call start() first (and after shutdown(), "
                               f"start() again).")
        if self._broken is not None:
            raise RunError(f"gpucomm.ray: {what}() refused: this executor's job lost a worker ({self._broken}), so its "
                           f"collectives cannot complete. Call shutdown() and start the executor again.")

    def _where(self) -> list[str]:
        return [f"node {i.node_ip}, pid {i.pid}" for i in self._infos]

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the workers (their processes exit), give back their resources and close the store.
        Safe to call twice."""
        try:
            if self.workers:
                self.leftover_pids = stop_actors(self.workers, [(i.node_ip, i.pid) for i in self._infos],
                                                 graceful=self._broken is None)
        finally:
            self._release()

    def _release(self) -> None:
        workers, self.workers, self._infos = self.workers, [], []
        if workers:  # stopped already, unless start() failed half-way
            for w in workers:
                try:
                    ray.kill(w, no_restart=True)
                except (ray.exceptions.RayError, ValueError):
                    pass
        if self._placement is not None:
            self._placement.release()
            self._placement = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self._pump = None
        self._broken = None


__all__ = ["RayExecutor"]
