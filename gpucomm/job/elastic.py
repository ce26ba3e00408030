"""A worker's side of the elastic rounds: which round to join at ``init()``, and whether a newer one
exists while it forms.

A worker always joins a round newer than the last one it took part in: after a failure its old
round is broken, and after a host change a newer round is already published. When no newer round
exists yet (a collective failed without any worker dying), the worker asks the launcher for one.
What a worker has joined lives in one ``Membership`` (held by the job lifecycle, ``gpucomm.job``);
the round a job is built from reaches it as a value (``JoinedRound``).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ..bootstrap import rounds
from ..bootstrap.launch_env import (GPUCOMM_ELASTIC_WORKER, GPUCOMM_RENDEZVOUS_ADDR, GPUCOMM_RENDEZVOUS_PORT,
                                    GPUCOMM_RUN_ID, GPUCOMM_SECRET)
from ..bootstrap.placement import placement_env
from ..bootstrap.rendezvous import RendezvousClient
from ..errors import GpucommError, RoundReplaced, WorkerRemoved

log = logging.getLogger("gpucomm")

WORKER_VAR = GPUCOMM_ELASTIC_WORKER
POLL_S = 0.05


@dataclass(frozen=True)
class JoinedRound:
    """The round a worker joined: its number, the environment that places the worker in it
    (``GPUCOMM_RANK`` ... set), whether it (or one since the worker's last) brought workers
    that do not hold the trained state yet (the state must then be synced), and whether this
    worker was in a round that formed before (``veteran``: its install is the job's)."""

    number: int
    env: dict[str, str]
    new_workers: bool
    veteran: bool = False


class Membership:
    """The rounds this process joined (none outside elastic mode)."""

    def __init__(self) -> None:
        self.last = 0  # the round this process last joined (0: none yet)
        self.formed = 0  # the last round this process joined that formed (its job was built; 0: none yet)

    def join(self, env: Mapping[str, str]) -> JoinedRound:
        """Wait for a round newer than the last one joined that places this worker. Raises
        ``WorkerRemoved`` when the launcher removed this worker, ``GpucommError`` when the launcher
        ended the job or no round came within the elastic timeout."""
        worker = env.get(WORKER_VAR)
        if not worker:
            raise GpucommError(f"GPUCOMM_ELASTIC=1 but {WORKER_VAR} is not set: elastic workers are started by "
                               f"gpucomm-run --host-discovery-script/--min-np, which names each worker.")
        run_id = env.get(GPUCOMM_RUN_ID, "")
        timeout = rounds.elastic_timeout(env)
        client = _client(env, timeout)
        try:
            if self.last:
                client.set(rounds.want_key(run_id, worker), str(self.last).encode())
            deadline = time.monotonic() + timeout
            while True:
                if client.check([rounds.fatal_key(run_id)]):
                    raise GpucommError(f"the launcher ended the elastic job: "
                                       f"{client.get(rounds.fatal_key(run_id)).decode()}")
                newest = int(client.get(rounds.round_key(run_id))) if client.check([rounds.round_key(run_id)]) else 0
                if newest > self.last and client.check([rounds.placement_key(run_id, newest, worker)]):
                    placement = rounds.decode_placement(client.get(rounds.placement_key(run_id, newest, worker)))
                    # since the last round whose job this worker built: a round given up while it formed may
                    # have been the one that added the hosts, whose workers still need the state
                    new_workers = any(client.check([rounds.hosts_added_key(run_id, n)])
                                      for n in range(self.formed + 1, newest + 1))
                    self.last = newest
                    if isinstance(placement, str):
                        removed = WorkerRemoved(worker, placement)
                        print(str(removed), file=sys.stderr, flush=True)  # SystemExit(0) itself prints nothing
                        raise removed
                    log.info("elastic: worker %s joins round %d as rank %d of %d", worker, newest, placement.rank,
                             placement.size)
                    return JoinedRound(newest, dict(env) | placement_env(placement), new_workers, self.formed > 0)
                if time.monotonic() > deadline:
                    raise GpucommError(
                        f"elastic worker {worker} waited {timeout:g} s for the launcher to form a new round (after "
                        f"round {self.last}) and none came. Likely causes: fewer hosts than --min-np, or the launcher "
                        f"is gone. Raise --elastic-timeout / HOROVOD_ELASTIC_TIMEOUT if hosts take longer to appear.")
                time.sleep(POLL_S)
        finally:
            client.close()


def _client(env: Mapping[str, str], timeout: float) -> RendezvousClient:
    try:
        addr, port = env[GPUCOMM_RENDEZVOUS_ADDR], int(env[GPUCOMM_RENDEZVOUS_PORT])
        secret = bytes.fromhex(env[GPUCOMM_SECRET])
    except (KeyError, ValueError) as e:
        raise GpucommError(f"elastic mode needs the store's address, port and secret from gpucomm-run ({e} is "
                           f"missing or malformed): start elastic jobs with gpucomm-run --min-np/--max-np/"
                           f"--host-discovery-script.") from None
    return RendezvousClient(addr, port, secret, connect_timeout=timeout, timeout=timeout)


def round_interrupt(client: RendezvousClient, run_id: str, number: int) -> Callable[[], None]:
    """For the waits of ``init()`` in elastic mode: raises ``RoundReplaced`` once the launcher has
    published a round newer than ``number``, the one this process is joining."""
    key = rounds.round_key(run_id)

    def interrupt() -> None:
        if client.check([key]) and int(client.get(key)) > number:
            raise RoundReplaced(f"the launcher replaced elastic round {number} before it was formed (a worker died or "
                                f"the hosts changed); joining the next round.")

    return interrupt


def newest_round(client: RendezvousClient, run_id: str, current: int) -> tuple[int, bool]:
    """The newest round and whether it, or one between it and ``current``, added hosts (the state must
    then be synced): two host changes between commits publish two rounds, the first may add them."""
    newest = int(client.get(rounds.round_key(run_id)))
    return newest, any(client.check([rounds.hosts_added_key(run_id, n)]) for n in range(current + 1, newest + 1))


__all__ = ["JoinedRound", "Membership", "WORKER_VAR", "newest_round", "round_interrupt"]
