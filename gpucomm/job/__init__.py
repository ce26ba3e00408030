"""The job this process belongs to: ``init`` builds it (``setup.py``), ``current`` returns it,
``shutdown`` takes it down; ``state.Job`` is what one initialized job owns. Importing this
package is light: the job's machinery (``setup``, ``state``) loads at the first ``init``.

One concept, one package: the lifecycle here, the job's state in ``state.py``, the steps of
``init`` in ``setup.py``, and an elastic worker's rounds in ``elastic.py``. Re-init after shutdown
starts a new generation, whose store keys never collide with the last one's. In elastic mode
``init`` first joins the launcher's next round (the membership below remembers which rounds this
process joined) and hands it to the job's setup as a value.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import failures
from ..bootstrap.rounds import elastic_mode
from ..errors import NotInitializedError, RoundReplaced
from ..settings import TIMELINE, TIMELINE_MARK_CYCLES
from .elastic import Membership

if TYPE_CHECKING:
    from .state import Job

_job: Job | None = None
_generation = 0
_lock = threading.Lock()
_membership = Membership()  # the elastic rounds this process joined (none outside elastic mode)
log = logging.getLogger("gpucomm")


def current() -> Job:
    """The initialized job, or ``NotInitializedError`` (a ValueError, as in Horovod)."""
    job = _job
    if job is None:
        raise NotInitializedError()
    return job


def active() -> Job | None:
    """The initialized job, or None (no error): for code that must tell an old job from the current one."""
    return _job


def is_initialized() -> bool:
    return _job is not None


def init(process_sets: Sequence[Sequence[int]] | str | None = None) -> Job:
    """Join the job described by the environment; idempotent while initialized.

    ``process_sets``: the ranks of each process set to register now (ids 1, 2, ... in order, the
    same list on every rank), or ``"dynamic"`` to allow ``add_process_set`` later."""
    global _job, _generation
    with _lock:
        if _job is not None:
            return _job
        from .setup import build_job  # noqa: PLC0415 - the job's machinery loads at init, not at import

        _generation += 1
        if elastic_mode(os.environ):
            job = _job = _join_a_round(build_job, process_sets)
        else:
            job = _job = build_job(os.environ, _generation, process_sets)
        failures.set_reporter(lambda exc: _report(job, exc))
        path = TIMELINE.read(os.environ)
        if path and path.upper() != "DYNAMIC":
            try:
                job.start_timeline(path, mark_cycles=TIMELINE_MARK_CYCLES.read(os.environ, False))
            except BaseException:
                _job = None
                job.close()
                raise
        return job


ROUND_ATTEMPTS = 20  # elastic rounds a worker's init() may see given up in a row before it raises


def _join_a_round(build_job: Callable[..., Job], process_sets: Any) -> Job:
    """(elastic mode, holding ``_lock``) Join the launcher's next round and build the job in it; a round
    given up while it formed (``RoundReplaced``: the launcher published a newer one, or a newcomer's
    install was refused) is followed by the next, also on a worker's first ``init()`` (it would
    otherwise exit and have its host blacklisted).

    A job built after such a retry counts as bringing workers without the state
    (``new_workers_joined``), so that ``hvd.elastic.run`` syncs: a round can form on some ranks and
    be given up on others (rank 0 still accepting the control links when a newer round came), and
    those that formed it sync after their first collective fails; the others must sync too."""
    for attempt in range(ROUND_ATTEMPTS):
        joined = _membership.join(os.environ)
        os.environ.update(joined.env)  # what the script reads (hvd.rank(), os.environ) matches the round it joined
        try:
            job = build_job(os.environ, _generation, process_sets, joined)
            _membership.formed = joined.number
            if attempt:
                job.new_workers_joined = True
            return job
        except RoundReplaced as e:
            if attempt == ROUND_ATTEMPTS - 1:
                raise
            log.warning("gpucomm elastic: round %d was given up while it formed (%s); joining the next one",
                        joined.number, str(e).splitlines()[0])
    raise AssertionError("unreachable")


def _report(job: Job, exc: BaseException) -> None:
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


def reset_process_history() -> None:
    """Forget this process's past jobs (the generation count and the elastic rounds joined), as
    if it had just started: for a process reused as a fresh rank (the test harness's pooled
    workers). Call it only with no job initialized."""
    global _generation, _membership
    with _lock:
        if _job is not None:
            raise RuntimeError("reset_process_history() with a job initialized: call shutdown() first.")
        _generation = 0
        _membership = Membership()


def shutdown() -> None:
    """Leave the job; pending operations fail with ``ShutdownError``. Safe to call twice."""
    global _job
    with _lock:
        job, _job = _job, None
    failures.set_reporter(None)
    if job is not None:
        job.close()


atexit.register(shutdown)

__all__ = ["active", "current", "init", "is_initialized", "reset_process_history", "shutdown"]
