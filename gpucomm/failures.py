"""Failure reports through the rendezvous store, so the job can name its *first* failure.

When one rank raises, the others usually fail a moment later with a secondary error ("connection
closed by peer") and may even exit first. Each rank's uncaught exception is therefore written to the
store, in the order the store receives them, before the rank tears down its connections; the
launcher (which hosts the store) reads them back to report the root cause, not its echoes.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Callable, Mapping

REPORT_TIMEOUT = 2.0  # seconds a failing rank spends at most on reporting before it goes on dying


@dataclass(frozen=True)
class Failure:
    """One rank's uncaught exception as reported, numbered in arrival order."""

    order: int
    rank: int
    host: str
    error: str


def _prefix(run_id: str) -> str:
    return f"{run_id}/failures/"


def record_failure(client, run_id: str, rank: int, host: str, error: str) -> None:
    """Append one report (``client`` is a ``RendezvousClient``)."""
    order = client.add(_prefix(run_id) + "count", 1)
    body = json.dumps({"rank": rank, "host": host, "error": error, "time": time.time()}).encode()
    client.set(f"{_prefix(run_id)}{order:08d}", body)


def read_failures(snapshot: Mapping[str, bytes], run_id: str) -> list[Failure]:
    """The reports in a store snapshot (``RendezvousServer.snapshot``), first failure first."""
    out = []
    for key, value in snapshot.items():
        tail = key[len(_prefix(run_id)):]
        if key.startswith(_prefix(run_id)) and tail.isdigit():
            rec = json.loads(value)
            out.append(Failure(int(tail), int(rec["rank"]), str(rec["host"]), str(rec["error"])))
    return sorted(out, key=lambda f: f.order)


def summarize(exc: BaseException) -> str:
    """``Type: message`` on one line, cut to a readable length."""
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 500 else text[:497] + "..."


_installed = False
_reporter: Callable[[BaseException], None] | None = None


def set_reporter(reporter: Callable[[BaseException], None] | None) -> None:
    """Route uncaught exceptions of the main thread to ``reporter`` (None: stop reporting); the
    previous ``sys.excepthook`` still prints the traceback afterwards."""
    global _installed, _reporter
    _reporter = reporter
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        report(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def report(exc: BaseException) -> None:
    """Report ``exc`` as this rank's failure now, as an uncaught exception is reported: for hosts that
    catch a rank's exceptions themselves (a Ray actor lives on after its function raised), so that
    the other ranks fail at once naming it instead of waiting in a collective. At most
    ``REPORT_TIMEOUT`` seconds; nothing without an initialized job."""
    reporter = _reporter
    if reporter is not None:
        t = threading.Thread(target=_quietly, args=(reporter, exc), name="gpucomm-failure-report", daemon=True)
        t.start()
        t.join(REPORT_TIMEOUT)


def _quietly(reporter: Callable[[BaseException], None], exc: BaseException) -> None:
    try:
        reporter(exc)
    except Exception:  # the store may be gone already; the traceback is printed regardless
        pass


__all__ = ["Failure", "read_failures", "record_failure", "report", "set_reporter", "summarize"]
