"""The Ray actor every worker of a job runs in (Horovod's ``BaseHorovodWorker``): it reports where
Ray placed it, takes the environment that places it in the job, and runs the functions the
executor sends. The executor applies ``ray.remote`` to it (with the resources and placement it
chooses), so the class stays a plain class that a script may subclass."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ray

from .. import failures
from ..errors import WorkerRemoved


def describe_process() -> dict[str, Any]:
    """Where Ray placed the calling actor: node id and IP, host name, pid and its GPU ids."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


def set_env(env_vars: Mapping[str, Any]) -> None:
    """Set environment variables in the calling process (before ``hvd.init()`` reads them)."""
    os.environ.update({str(k): str(v) for k, v in env_vars.items()})


def leave_job() -> None:
    """Leave gpucomm's job in the calling process if its training loaded gpucomm's torch front (as
    ``hvd.shutdown()`` would; looked up, never imported: the workers' front is the user's choice)."""
    front = sys.modules.get("gpucomm.torch")
    if front is not None:
        front.shutdown()


@dataclass(frozen=True)
class Removed:
    """What an elastic worker's function returns when the driver left the worker out of the job
    (``WorkerRemoved`` is a ``SystemExit``, which would end the actor's process instead)."""

    worker: str
    why: str


class BaseGpucommWorker:
    """One worker process of a job on Ray. ``executable`` is the instance of the executor's
    ``executable_cls`` (None without one); ``execute(fn)`` calls ``fn(executable)``."""

    executable: Any = None

    def describe(self) -> dict[str, Any]:
        """Where Ray placed this actor (``describe_process``)."""
        return describe_process()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list:
        """The CUDA device ids Ray assigned to this actor."""
        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Set environment variables in this worker process (before ``hvd.init()`` reads them)."""
        set_env(env_vars)

    def env_vars(self) -> dict[str, str]:
        """This worker process's environment."""
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None, executable_args: list | None = None,
                         executable_kwargs: dict | None = None) -> None:
        """Instantiate ``executable_cls(*args, **kwargs)`` in this worker (after its environment is set)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()), **(executable_kwargs or {}))

    def prepare(self, env_vars: Mapping[str, Any], executable_cls: type | None = None,
                executable_args: list | None = None, executable_kwargs: dict | None = None, *,
                own_gpu_only: bool = False) -> dict[str, Any]:
        """``update_env_vars``, then ``start_executable``, in one call; returns ``describe()``. With
        ``own_gpu_only`` (elastic workers, whose local ranks change between rounds) the worker sees only
        the first GPU Ray gave it (none without GPUs), so gpucomm pins that one at every round; Ray's
        own setting is not relied on (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` turns it off)."""
        if own_gpu_only:
            env_vars = {**env_vars, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in ray.get_gpu_ids()[:1])}
        self.update_env_vars(env_vars)
        self.start_executable(executable_cls, executable_args, executable_kwargs)
        return self.describe()

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """``func(executable)``: the executor's ``execute``, ``run`` and ``run_remote`` all come here.
        An exception is reported to this worker's gpucomm job first, as a script's uncaught exception
        is, so the other ranks fail naming it instead of waiting for this one in a collective."""
        try:
            return func(self.executable)
        except Exception as e:
            failures.report(e)
            raise

    def execute_elastic(self, func: Callable[[Any], Any]) -> Any:
        """``execute`` for an elastic worker: the driver removing it returns ``Removed`` (the actor
        stays up until the driver stops it) instead of ending the process."""
        try:
            return self.execute(func)
        except WorkerRemoved as e:
            return Removed(e.worker, e.why)


@dataclass(frozen=True)
class CallWith:
    """``fn(*args, **kwargs)`` as a function of the worker's executable, which it ignores (what
    ``run`` sends to ``execute``)."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: Mapping[str, Any] | None = None

    def __call__(self, executable: Any) -> Any:
        return self.fn(*self.args, **(self.kwargs or {}))


BaseHorovodWorker = BaseGpucommWorker  # Horovod's name, for scripts that subclass or reference it

__all__ = ["BaseGpucommWorker", "BaseHorovodWorker", "CallWith", "Removed", "describe_process", "leave_job", "set_env"]
