"""gpucomm's log output: a stderr handler whose lines carry the rank, the level chosen by
``GPUCOMM_LOG_LEVEL`` / ``HOROVOD_LOG_LEVEL`` (``gpucomm-run --log-level``; ``--verbose`` means
INFO), and the timings of ``init``'s set-up steps."""

from __future__ import annotations

import logging
import time
from typing import Mapping

from .settings import LOG_LEVEL, LOG_TIMESTAMP

log = logging.getLogger("gpucomm")

LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def _rank_handler(rank: int, timestamp: bool = False) -> logging.Handler:
    handler = next((h for h in log.handlers if getattr(h, "_gpucomm", False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler._gpucomm = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    when = "%(asctime)s " if timestamp else ""
    handler.setFormatter(logging.Formatter(f"{when}gpucomm rank {rank} %(levelname)s %(name)s: %(message)s"))
    return handler


def configure_logging(env: Mapping[str, str], rank: int) -> None:
    """Apply the log level from ``env`` (and ``GPUCOMM_LOG_TIMESTAMP``: lines start with the time);
    without a level, warnings (stall reports) and autotune's progress still reach stderr."""
    level, timestamp = LOG_LEVEL.read(env), LOG_TIMESTAMP.read(env, False)
    if level is not None:
        log.setLevel(LEVELS[level])
        logging.getLogger("gpucomm.autotune").setLevel(logging.NOTSET)  # the chosen level decides
        _rank_handler(rank, timestamp)
        return
    if not log.handlers and not logging.getLogger().handlers:
        _rank_handler(rank, timestamp).setLevel(logging.INFO)
    # Without a chosen level, gpucomm says only warnings, and what autotune does (the user asked for
    # it and would otherwise not know whether it ran, or what it chose): that logger speaks at INFO.
    logging.getLogger("gpucomm.autotune").setLevel(logging.INFO)


class SetupSteps:
    """Times the set-up steps of ``init`` for the log (gpucomm-run --verbose shows them)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        log.info("init: %s in %.3f s (%.3f s since init began)", what, now - self.last, now - self.start)
        self.last = now


__all__ = ["LEVELS", "SetupSteps", "configure_logging", "log"]
