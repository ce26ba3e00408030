"""Values a worker logs for the driver's callbacks (Horovod's ``horovod.ray.ray_logger``).

In a worker: ``ray_logger.log({"loss": 0.1})``. Each value is pickled into the job's authenticated
store (no extra actor); the executor's ``run``/``execute``/elastic ``run`` pass every value, in
the order logged, to each of their ``callbacks`` while the workers run, and delete it once passed.
Outside the workers of a ``gpucomm.ray`` executor's job (Ray Train's, for one: report metrics
with ``ray.train.report`` there) ``log`` warns once and drops the value, as Horovod does.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any, Callable, Sequence

from ..bootstrap.rendezvous import RendezvousClient
from ..runner.run_task import dumps
from .store import DriverStore


def _key(run_id: str, what: str) -> str:
    return f"{run_id}/ray/log/{what}"


class _Sender:
    """This process's connection to its job's store (opened on the first ``log``), and whether the
    job's driver passes logged values on (it says so in the store)."""

    client: RendezvousClient | None = None
    run_id = ""
    enabled = False
    warned = False


def log(info: Any) -> None:
    """Send ``info`` (anything picklable) to the driver's callbacks."""
    env = os.environ
    run_id = env.get("GPUCOMM_RUN_ID", "")
    if run_id and env.get("GPUCOMM_SECRET") and _Sender.run_id != run_id:
        if _Sender.client is not None:
            _Sender.client.close()
        _Sender.client = RendezvousClient(env["GPUCOMM_RENDEZVOUS_ADDR"], int(env["GPUCOMM_RENDEZVOUS_PORT"]),
                                          bytes.fromhex(env["GPUCOMM_SECRET"]), connect_timeout=30.0, timeout=30.0)
        _Sender.run_id, _Sender.enabled = run_id, _Sender.client.check([_key(run_id, "enabled")])
    if not (run_id and _Sender.run_id == run_id and _Sender.enabled):
        if not _Sender.warned:
            warnings.warn("gpucomm.ray.ray_logger.log called but logging is not configured: only the workers of a "
                          "gpucomm.ray executor's job pass logged values to the driver's callbacks.", stacklevel=2)
            _Sender.warned = True
        return
    order = _Sender.client.add(_key(run_id, "count"), 1)
    _Sender.client.set(_key(run_id, f"{order:010d}"), dumps(info))


class LogPump:
    """The driver's side, one per job: passes logged values to the callbacks of the call that is
    running, in order, and deletes them from the store (values logged while no callback listens
    are dropped, as Horovod drops them)."""

    def __init__(self, store: DriverStore) -> None:
        self.store = store
        self.next = 1
        store.server.put(_key(store.run_id, "enabled"), b"1")  # the workers' log() sends values

    def poll(self, callbacks: Sequence[Callable[[Any], Any]] | None, *, final: bool = False) -> None:
        """Pass on every value logged so far, in order; ``final``: also those after a gap (a worker
        that died between taking a number and storing its value)."""
        prefix = _key(self.store.run_id, "")
        logged = {k: v for k, v in self.store.server.snapshot(prefix).items() if k[len(prefix):].isdigit()}
        if final:
            order = sorted(logged)
        else:
            order = []
            while _key(self.store.run_id, f"{self.next + len(order):010d}") in logged:
                order.append(_key(self.store.run_id, f"{self.next + len(order):010d}"))
        for key in order:
            self.store.client().delete(key)
            self.next = max(self.next, int(key[len(prefix):]) + 1)
            value = pickle.loads(logged[key])
            for callback in callbacks or ():
                callback(value)


__all__ = ["LogPump", "log"]
