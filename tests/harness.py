"""Run a function in N real rank processes and fail with every failing rank's traceback.

Ranks are spawned (fresh interpreters, as a launcher would start them), talk to a rendezvous store
hosted by the test process on a free port, each has a deadline, and every process is reaped: a rank
still alive at the deadline is killed, together with its children.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
import traceback
from typing import Any, Callable, Sequence

from gpucomm.bootstrap.rendezvous import RendezvousServer

_CTX = mp.get_context("spawn")
FAILURE_GRACE = 10.0  # seconds the other ranks get to report once one rank has failed


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each one's traceback."""


def _entry(fn: Callable[..., Any], env: dict[str, str], args: tuple, conn) -> None:
    os.environ.update(env)
    try:
        result = fn(*args)
        conn.send(("ok", result))
    except BaseException:  # report everything, including SystemExit and assertion errors
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def rank_env(rank: int, size: int, port: int, secret: bytes, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "GPUCOMM_RANK": str(rank), "GPUCOMM_SIZE": str(size),
        "GPUCOMM_LOCAL_RANK": str(rank), "GPUCOMM_LOCAL_SIZE": str(size),
        "GPUCOMM_CROSS_RANK": "0", "GPUCOMM_CROSS_SIZE": "1",
        "GPUCOMM_RENDEZVOUS_ADDR": "127.0.0.1", "GPUCOMM_RENDEZVOUS_PORT": str(port),
        "GPUCOMM_RENDEZVOUS_HOSTED": "1", "GPUCOMM_SECRET": secret.hex(),
        "GPUCOMM_TIMEOUT": "60", "GPUCOMM_START_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def run_ranks(fn: Callable[..., Any], size: int, *, args: tuple = (), timeout: float = 120.0,
              env: dict[str, str] | None = None, ranks: Sequence[int] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ranks ``ranks`` (default all) of a ``size``-rank job; return their results."""
    secret = secrets.token_bytes(32)
    ranks = list(range(size)) if ranks is None else list(ranks)
    with RendezvousServer(secret, "127.0.0.1", 0) as server:
        procs = []
        for r in ranks:
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_entry, args=(fn, rank_env(r, size, server.port, secret, env), args, child),
                             name=f"rank{r}", daemon=True)
            p.start()
            child.close()
            procs.append((r, p, parent))
        deadline = time.monotonic() + timeout
        outcomes: dict[int, tuple[str, Any]] = {}
        try:
            pending = list(procs)
            while pending and time.monotonic() < deadline:
                for item in list(pending):
                    r, p, conn = item
                    if conn.poll(0.05):
                        try:
                            outcomes[r] = conn.recv()
                        except EOFError:
                            outcomes[r] = ("error", f"rank {r} exited (code {p.exitcode}) without reporting")
                        pending.remove(item)
                        if outcomes[r][0] != "ok":  # the others get a short grace to report, then are killed
                            deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                    elif not p.is_alive() and not conn.poll(0):
                        outcomes[r] = ("error", f"rank {r} died with exit code {p.exitcode} without reporting")
                        pending.remove(item)
            for r, p, _ in pending:
                outcomes[r] = ("error", f"rank {r} did not finish in time (killed)")
        finally:
            for _, p, conn in procs:
                p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
                conn.close()
    failures = [f"--- rank {r} ---\n{v}" for r, (status, v) in sorted(outcomes.items()) if status != "ok"]
    if failures:
        raise RankFailure(f"{len(failures)} of {len(ranks)} ranks failed:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in ranks]
