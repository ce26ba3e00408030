"""``hvd.elastic.run``: retry the training function when the job's membership changes.

Horovod's loop: sync the state (unless hosts were only removed), run the function; on a failed
collective restore the last commit, on a host change keep the state; then leave the job, join the
launcher's next round (``hvd.init()`` waits for it) and run the state's reset callbacks.

Where gpucomm goes further: a re-form that fails (another worker dies while the round forms, or
during the reset callbacks' collectives) is retried with the next round instead of ending the
worker; the state is synced whenever the rounds joined meanwhile brought new workers, even if the
interrupt itself was a removal, and whenever any rank of the re-formed job needs it (the ranks agree
first); and the launcher is told which workers hold the trained state and
when training has finished.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

from ...bootstrap import rounds
from ...counters import COUNTERS
from ...errors import CollectiveError, GpucommError, HostsUpdatedInterrupt, WorkerRemoved
from .. import init  # gpucomm.torch.init: it also binds the global process set
from ..functions import allgather_object
from ..submission import current_job, shutdown_job

log = logging.getLogger("gpucomm")

F = TypeVar("F", bound=Callable[..., Any])
MAX_REFORM_ATTEMPTS = 20  # rounds a worker may see fail while re-forming before it gives up


def run(func: F) -> F:
    """Decorate ``train(state, *args, **kwargs)`` so that it survives workers leaving and joining."""

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if sync_needed(skip_sync):
                    state.sync()
                _mark(rounds.holds_key)
                result = func(state, *args, **kwargs)
                _mark(rounds.done_key)
                return result
            except CollectiveError as e:  # HorovodInternalError: a rank died or a collective broke
                log.warning("gpucomm elastic: %s; restoring the last commit and re-forming the job",
                            str(e).splitlines()[0])
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            skip_sync = _reform(state, skip_sync)

    return wrapper  # type: ignore[return-value]


def sync_needed(skip_sync: bool) -> bool:
    """Whether the job (re-formed, or just started) syncs the state: where any of its ranks needs it.

    Each rank judges from its own history (the interrupt, the rounds it saw given up, those that added
    hosts since the last round it formed), and two ranks of one round can judge differently: a slow rank
    that never read the number of a round given up elsewhere never retried. A rank that syncs alone
    broadcasts while the others train, and both wait out ``GPUCOMM_TIMEOUT``. So in elastic mode the
    ranks agree first, with one small collective per re-form; outside it only ``skip_sync`` counts."""
    if not rounds.elastic_mode():
        return not skip_sync
    return any(allgather_object(not skip_sync, name="gpucomm.elastic.sync_needed"))


def _mark(key_of: Callable[[str, str], str]) -> None:
    if rounds.elastic_mode():
        current_job().tell_launcher(key_of)


def _reform(state, skip_sync: bool) -> bool:
    """Leave the broken or outdated job, join the launcher's next round and run the state's reset
    callbacks. Returns whether the next ``sync()`` may be skipped. A round that fails while it
    forms, or whose reset callbacks' collectives fail, is followed by the next one."""
    t0 = time.monotonic()
    for attempt in range(MAX_REFORM_ATTEMPTS):
        try:
            shutdown_job()
        except Exception as e:  # noqa: BLE001 - the old job is left either way; its teardown must not end this worker
            log.warning("gpucomm elastic: leaving the old job raised %s: %s; joining the next round anyway",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        try:
            init()
            job = current_job()
            skip_sync = skip_sync and not job.new_workers_joined
            state.on_reset()
            COUNTERS.elastic_resets += 1
            log.info("gpucomm elastic: re-formed in %.2f s (round %d)", time.monotonic() - t0, job.elastic_round)
            return skip_sync
        except WorkerRemoved:
            raise
        except CollectiveError as e:  # a reset callback's collective (the optimizer's rebind) failed
            log.warning("gpucomm elastic: re-forming failed (%s); restoring the last commit and trying the next "
                        "round", str(e).splitlines()[0])
            state.restore()
            skip_sync = False
        except Exception as e:  # noqa: BLE001 - joining failed: a worker died while the round formed
            if (isinstance(e, GpucommError) and "launcher ended the elastic job" in str(e)) \
                    or attempt == MAX_REFORM_ATTEMPTS - 1:
                raise
            log.warning("gpucomm elastic: joining a round failed (%s: %s); trying the next one", type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            skip_sync = False
    raise AssertionError("unreachable")


__all__ = ["run", "sync_needed"]
