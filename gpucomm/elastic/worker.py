"""A worker's side of the rounds: which round to join at ``init()``, and whether a newer one exists.

A worker always joins a round newer than the last one it took part in: after a failure its old
round is broken, and after a host change a newer round is already published. When no newer round
exists yet (a collective failed without any worker dying), the worker asks the launcher for one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable, Mapping

from ..bootstrap.rendezvous import RendezvousClient
from ..errors import GpucommError
from ..runner.worker_env import slot_env
from . import rounds

log = logging.getLogger("gpucomm")

WORKER_VAR = "GPUCOMM_ELASTIC_WORKER"
POLL_S = 0.05

PLACEMENT_VARS = tuple(slot_env(rounds.Placement("", 0, 1, 0, 1, 0, 1)))
_last_round = 0  # the round this process last joined (0: none yet)
_current_round = 0  # the round of the job that is initialized now (0: none)
_new_workers = False  # whether a round since the last one joined brought workers without the state


class WorkerRemoved(SystemExit):
    """The launcher left this worker out of the job (its host was removed or blacklisted, or the
    job has more workers than --max-np): the process ends with status 0."""

    def __init__(self, worker: str, why: str) -> None:
        super().__init__(0)
        self.worker, self.why = worker, why

    def __str__(self) -> str:
        return f"gpucomm elastic: worker {self.worker} leaves the job: {self.why}"


def _client(env: Mapping[str, str], timeout: float) -> RendezvousClient:
    try:
        addr, port = env["GPUCOMM_RENDEZVOUS_ADDR"], int(env["GPUCOMM_RENDEZVOUS_PORT"])
        secret = bytes.fromhex(env["GPUCOMM_SECRET"])
    except (KeyError, ValueError) as e:
        raise GpucommError(f"elastic mode needs the store's address, port and secret from gpucomm-run ({e} is "
                           f"missing or malformed): start elastic jobs with gpucomm-run --min-np/--max-np/"
                           f"--host-discovery-script.") from None
    return RendezvousClient(addr, port, secret, connect_timeout=timeout, timeout=timeout)


def join_round(env: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """Wait for a round newer than the last one joined that places this worker; returns the
    environment that describes this process in it (``GPUCOMM_RANK`` ... set) and its number.
    Raises ``WorkerRemoved`` when the launcher removed this worker, ``GpucommError`` when the
    launcher ended the job or no round came within the elastic timeout."""
    global _last_round, _current_round, _new_workers
    worker = env.get(WORKER_VAR)
    if not worker:
        raise GpucommError(f"GPUCOMM_ELASTIC=1 but {WORKER_VAR} is not set: elastic workers are started by "
                           f"gpucomm-run --host-discovery-script/--min-np, which names each worker.")
    run_id = env.get("GPUCOMM_RUN_ID", "")
    timeout = rounds.elastic_timeout(env)
    client = _client(env, timeout)
    try:
        if _last_round:
            client.set(rounds.want_key(run_id, worker), str(_last_round).encode())
        deadline = time.monotonic() + timeout
        while True:
            if client.check([rounds.fatal_key(run_id)]):
                raise GpucommError(f"the launcher ended the elastic job: {client.get(rounds.fatal_key(run_id)).decode()}")
            newest = int(client.get(rounds.round_key(run_id))) if client.check([rounds.round_key(run_id)]) else 0
            if newest > _last_round and client.check([rounds.placement_key(run_id, newest, worker)]):
                placement = rounds.decode_placement(client.get(rounds.placement_key(run_id, newest, worker)))
                _new_workers = any(client.check([rounds.hosts_added_key(run_id, n)])
                                   for n in range(_last_round + 1, newest + 1))
                _last_round = newest
                if isinstance(placement, str):
                    removed = WorkerRemoved(worker, placement)
                    print(str(removed), file=sys.stderr, flush=True)  # SystemExit(0) itself prints nothing
                    raise removed
                _current_round = newest
                log.info("elastic: worker %s joins round %d as rank %d of %d", worker, newest, placement.rank,
                         placement.size)
                return dict(env) | slot_env(placement), newest
            if time.monotonic() > deadline:
                raise GpucommError(
                    f"elastic worker {worker} waited {timeout:g} s for the launcher to form a new round (after round "
                    f"{_last_round}) and none came. Likely causes: fewer hosts than --min-np, or the launcher is "
                    f"gone. Raise --elastic-timeout / HOROVOD_ELASTIC_TIMEOUT if hosts take longer to appear.")
            time.sleep(POLL_S)
    finally:
        client.close()


class RoundReplaced(GpucommError):
    """The launcher published a newer round while this one was forming (a worker died or the hosts
    changed): the worker leaves it and joins the next one."""


def round_interrupt(client: RendezvousClient, run_id: str) -> Callable[[], None]:
    """For the waits of ``init()`` in elastic mode: raises ``RoundReplaced`` once the launcher has
    published a round newer than the one this process is joining."""
    key = rounds.round_key(run_id)

    def interrupt() -> None:
        if client.check([key]) and int(client.get(key)) > _current_round:
            raise RoundReplaced(f"the launcher replaced elastic round {_current_round} before it was formed (a "
                                f"worker died or the hosts changed); joining the next round.")

    return interrupt


def newest_round(client: RendezvousClient, run_id: str) -> tuple[int, bool]:
    """The newest round and whether it was formed because hosts were added (state must be synced)."""
    newest = int(client.get(rounds.round_key(run_id)))
    return newest, newest > _current_round and client.check([rounds.hosts_added_key(run_id, newest)])


def current_round() -> int:
    return _current_round


def new_workers_joined() -> bool:
    """Whether the round just joined (or one between it and the last) added workers that do not
    hold the trained state yet: the state must then be synced even after a host removal."""
    return _new_workers


def mark(key_of: Callable[[str, str], str]) -> None:
    """Tell the launcher something about this worker (``rounds.holds_key`` / ``rounds.done_key``)."""
    from .. import runtime  # noqa: PLC0415

    job = runtime.current()
    job.client.set(key_of(job.world.run_id, os.environ.get(WORKER_VAR, "")), str(_current_round).encode())


def left_round() -> None:
    """The job of the current round was shut down."""
    global _current_round
    _current_round = 0


__all__ = ["RoundReplaced", "WorkerRemoved", "current_round", "join_round",
           "left_round", "mark", "new_workers_joined", "newest_round", "round_interrupt"]
