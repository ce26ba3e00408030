"""The job this process belongs to, if any: ``init`` builds it, ``shutdown`` takes it down.

Light on purpose: importing this module loads nothing heavy; the first ``init()`` loads the job's
machinery (``gpucomm.startup``). Re-init after shutdown starts a new generation, whose store keys
never collide with the last one's.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING, Sequence

from . import failures
from .errors import NotInitializedError
from .settings import env_flag

if TYPE_CHECKING:
    from .job import Job

_job: "Job | None" = None
_generation = 0
_lock = threading.Lock()


def current() -> "Job":
    """The initialized job, or ``NotInitializedError`` (a ValueError, as in Horovod)."""
    job = _job
    if job is None:
        raise NotInitializedError()
    return job


def is_initialized() -> bool:
    return _job is not None


def init(process_sets: Sequence[Sequence[int]] | str | None = None) -> "Job":
    """Join the job described by the environment; idempotent while initialized.

    ``process_sets``: the ranks of each process set to register now (ids 1, 2, ... in order, the
    same list on every rank), or ``"dynamic"`` to allow ``add_process_set`` later."""
    global _job, _generation
    with _lock:
        if _job is not None:
            return _job
        from .startup import build_job  # noqa: PLC0415 - the heavy part, loaded on first use

        _generation += 1
        job = _job = build_job(os.environ, _generation, process_sets)
        failures.set_reporter(lambda exc: _report(job, exc))
        path = os.environ.get("GPUCOMM_TIMELINE") or os.environ.get("HOROVOD_TIMELINE")
        if path and path.upper() != "DYNAMIC":
            try:
                job.start_timeline(path, mark_cycles=env_flag(os.environ, ("GPUCOMM_TIMELINE_MARK_CYCLES",
                                                                           "HOROVOD_TIMELINE_MARK_CYCLES")))
            except BaseException:
                _job = None
                job.close()
                raise
        return job


def _report(job: "Job", exc: BaseException) -> None:
    """An uncaught exception is ending this rank: tell the coordinator (so every rank names it as
    the cause) and the store (so the launcher does)."""
    text = failures.summarize(exc)
    # the store first: once the coordinator knows, the other ranks fail and may exit, and the
    # launcher's report reads the store to name the cause
    try:
        failures.record_failure(job.client, job.world.run_id, job.world.rank, job.world.hostname, text)
    finally:
        if job.controller is not None:
            job.controller.report_failure(text)


def shutdown() -> None:
    """Leave the job; pending operations fail with ``ShutdownError``. Safe to call twice."""
    global _job
    with _lock:
        job, _job = _job, None
    failures.set_reporter(None)
    if job is not None:
        try:
            job.close()
        finally:
            if job.elastic:
                from .elastic.worker import left_round  # noqa: PLC0415

                left_round()


atexit.register(shutdown)

__all__ = ["current", "init", "is_initialized", "shutdown"]
