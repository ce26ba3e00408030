"""The rounds of an elastic job, as the launcher publishes them in the rendezvous store (data both
the launcher and the workers read: it sits below both).

A *round* is one membership of the job: which workers take part and each one's rank, size and
local/cross placement. The launcher (``gpucomm.runner.elastic_driver``) writes round ``n``'s
assignments first and then sets the round counter to ``n``, so a worker that reads the counter
always finds its assignment. Workers are named by a stable id (``host:slot``); ranks may change
between rounds, worker ids never do.

Keys (under ``{run_id}/elastic/``):
    round               the newest round number (decimal)
    r{n}/{worker}       that worker's assignment in round n (JSON), or ``{"removed": why}``
    r{n}/hosts_added    "1" when round n only exists because hosts were added (state must be synced)
    want/{worker}       the round a worker left after a failure: it asks for a newer one
    holds/{worker}      the worker holds the trained state (it finished a round's sync)
    done/{worker}       the worker's training function returned (the job is finishing)
    fatal               why the launcher ended the job (workers waiting for a round stop)
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Mapping

from ..settings import ELASTIC, ELASTIC_TIMEOUT
from .placement import Placement

DEFAULT_ELASTIC_TIMEOUT = 600.0  # Horovod's default


def elastic_mode(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by ``gpucomm-run`` in elastic mode (``env``: default this process's)."""
    return ELASTIC.read(env, False)


def elastic_timeout(env: Mapping[str, str]) -> float:
    """Seconds to wait for enough workers after a change (GPUCOMM_/HOROVOD_ELASTIC_TIMEOUT, default 600)."""
    return ELASTIC_TIMEOUT.read(env, DEFAULT_ELASTIC_TIMEOUT)


def base(run_id: str) -> str:
    return f"{run_id}/elastic/"


def round_key(run_id: str) -> str:
    return base(run_id) + "round"


def placement_key(run_id: str, number: int, worker: str) -> str:
    return f"{base(run_id)}r{number}/{worker}"


def hosts_added_key(run_id: str, number: int) -> str:
    return f"{base(run_id)}r{number}/hosts_added"


def want_key(run_id: str, worker: str) -> str:
    return f"{base(run_id)}want/{worker}"


def fatal_key(run_id: str) -> str:
    return base(run_id) + "fatal"


def holds_key(run_id: str, worker: str) -> str:
    """Set by a worker once it holds the trained state (after a round's sync)."""
    return f"{base(run_id)}holds/{worker}"


def done_key(run_id: str, worker: str) -> str:
    """Set by a worker when its training function has returned: the job is finishing."""
    return f"{base(run_id)}done/{worker}"


def encode_placement(placement: Placement | None, removed_because: str = "") -> bytes:
    return json.dumps(asdict(placement) if placement is not None else {"removed": removed_because}).encode()


def decode_placement(raw: bytes) -> Placement | str:
    """A ``Placement``, or the reason the worker was removed from the job."""
    data = json.loads(raw)
    if "removed" in data:
        return str(data["removed"])
    return Placement(**data)


__all__ = ["decode_placement", "done_key", "elastic_mode", "elastic_timeout", "encode_placement", "fatal_key", "holds_key",
           "hosts_added_key", "placement_key", "round_key", "want_key"]
