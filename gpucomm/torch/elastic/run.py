"""``hvd.elastic.run``: retry the training function when the job's membership changes.

Horovod's loop: sync the state (unless hosts were only removed), run the function; on a failed
collective restore the last commit, on a host change keep the state; then leave the job, join the
launcher's next round (``hvd.init()`` waits for it) and run the state's reset callbacks.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

from ... import runtime
from ...counters import COUNTERS
from ...errors import CollectiveError, GpucommError, HostsUpdatedInterrupt

log = logging.getLogger("gpucomm")

F = TypeVar("F", bound=Callable[..., Any])
MAX_JOIN_ATTEMPTS = 20  # rounds a worker may see replaced while joining before it gives up


def run(func: F) -> F:
    """Decorate ``train(state, *args, **kwargs)`` so that it survives workers leaving and joining."""

    @functools.wraps(func)
    def wrapper(state, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except CollectiveError as e:  # HorovodInternalError: a rank died or a collective broke
                log.warning("gpucomm elastic: %s; restoring the last commit and re-forming the job",
                            str(e).splitlines()[0])
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            _reset()
            state.on_reset()

    return wrapper  # type: ignore[return-value]


def _reset() -> None:
    """Leave the broken or outdated job and join the launcher's next round. A round that is
    replaced while it forms (another worker died meanwhile) is followed by the next one."""
    t0 = time.monotonic()
    for attempt in range(MAX_JOIN_ATTEMPTS):
        runtime.shutdown()
        try:
            from .. import init  # noqa: PLC0415 - gpucomm.torch.init binds the global process set

            init()
            break
        except GpucommError as e:
            if "launcher ended the elastic job" in str(e) or attempt == MAX_JOIN_ATTEMPTS - 1:
                raise
            log.warning("gpucomm elastic: joining a round failed (%s); trying the next one", str(e).splitlines()[0])
    COUNTERS.elastic_resets += 1
    log.info("gpucomm elastic: re-formed in %.2f s", time.monotonic() - t0)


__all__ = ["run"]
