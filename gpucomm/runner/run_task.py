"""One rank of a ``gpucomm.run`` job: ``python -m gpucomm.runner.run_task``.

Fetches the pickled ``(func, args, kwargs)`` the launcher published in the job's rendezvous store,
calls it (the function calls ``hvd.init()`` itself, as under ``horovod.run``), and stores the
pickled return value under this rank's key. An exception is stored with its traceback before it
propagates, so the launcher can raise the first failing rank's error; the rank then exits
non-zero as any script would.

Light on purpose: it loads nothing but the store client before the user's function does.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from typing import Any

from ..bootstrap.rendezvous import RendezvousClient
from ..bootstrap.world import detect_world
from ..settings import START_TIMEOUT

MAX_PAYLOAD = 64 << 20  # the store's frame limit (rendezvous.DEFAULT_MAX_FRAME); results above it cannot travel


def key(run_id: str, what: str) -> str:
    """The store key of one piece of a ``gpucomm.run`` job (payload, sys_path, result/<rank>, ...)."""
    return f"{run_id}/run_func/{what}"


def dumps(obj: Any) -> bytes:
    """cloudpickle when installed (lambdas, closures, functions of ``__main__``), else pickle."""
    try:
        import cloudpickle  # noqa: PLC0415
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def _error_record(rank: int, host: str, exc: BaseException) -> bytes:
    try:
        pickled = dumps(exc)
    except Exception:  # an exception that does not pickle still reports its type, text and traceback
        pickled = None
    return pickle.dumps({"rank": rank, "host": host, "type": type(exc).__name__, "message": str(exc),
                         "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                         "exception": pickled})


def _use_launcher_path(entries: list[str]) -> None:
    """Let the function's modules import as they did in the launcher (as multiprocessing's spawn
    does): its ``sys.path`` entries that exist here go after this interpreter's own."""
    for entry in entries:
        if entry not in sys.path and (entry == "" or os.path.isdir(entry)):
            sys.path.append(entry)


def main() -> int:
    env = os.environ
    # gpucomm-run's own launcher states the rank; under --mpi the MPI launcher's variables do
    place = detect_world(env).placement
    run_id, rank, host = env["GPUCOMM_RUN_ID"], place.rank, place.host
    start_timeout = START_TIMEOUT.read(env, 120.0)
    client = RendezvousClient(env["GPUCOMM_RENDEZVOUS_ADDR"], int(env["GPUCOMM_RENDEZVOUS_PORT"]),
                              bytes.fromhex(env["GPUCOMM_SECRET"]), connect_timeout=start_timeout,
                              timeout=start_timeout)
    try:
        try:
            _use_launcher_path(json.loads(client.get(key(run_id, "sys_path"))))
            func, args, kwargs = pickle.loads(client.get(key(run_id, "payload")))
            result = dumps(func(*args, **kwargs))
            if len(result) > MAX_PAYLOAD:
                raise ValueError(f"the function's return value on rank {rank} pickles to {len(result) / 2**20:.1f} "
                                 f"MiB, more than the {MAX_PAYLOAD >> 20} MiB the job's store carries; return "
                                 f"less (write large results to files and return their paths).")
        except BaseException as exc:
            try:
                order = client.add(key(run_id, "errors/count"), 1)  # arrival order: the first is the cause
                client.set(key(run_id, f"errors/{order:08d}"), _error_record(rank, host, exc))
            except Exception:  # the launcher is gone or the store broke: the exit status still tells
                pass
            raise
        client.set(key(run_id, f"result/{rank}"), result)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
