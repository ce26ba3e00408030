"""The watch loop both elastic drivers run: gpucomm-run's (``elastic_driver.py``: processes) and
gpucomm.ray's (``gpucomm/ray/elastic_driver.py``: actors).

Each pass takes the workers' ends, rediscovers hosts every ``interval``, reads the workers' requests
for a new round, stops removed workers that linger, and forms a new round once the reasons for one
have settled (events ``SETTLE_S`` apart form one round: a death is often followed by its echoes).
The loop ends when every member of the round has ended, or on a failure. How a worker is started,
watched and stopped is the driver's own (the abstract methods below); which rounds form, and what
they publish, is ``round_policy.RoundBook``'s.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Mapping, Protocol, Sequence

from ..errors import ElasticJobError
from .round_policy import RoundBook

SETTLE_S = 0.3  # events this close together form one round
SETTLE_POLL_S = 0.05  # how often the settling wait takes the workers' ends


class ElasticWorker(Protocol):
    """What the loop reads of a driver's worker."""

    number: int
    wid: str
    removed: str | None
    stopped_because: str | None

    @property
    def ended(self) -> bool: ...


class ElasticLoop:
    """The round-forming loop over a driver's workers (``_workers``: slot -> its latest worker).

    A subclass sets ``_book``, ``_workers``, ``_interval``, ``_reform_reasons``, ``_finishing`` and
    ``_failure`` in its constructor and implements the abstract methods."""

    DISCOVERY_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (Exception,)  # what a later discovery may raise

    _book: RoundBook
    _workers: Mapping[str, Any]  # slot -> its latest ElasticWorker
    _interval: float
    _reform_reasons: list[str]
    _finishing: bool
    _failure: str | None
    _hosts: Any

    # ------------------------------------------------------------------ the loop

    def _run_rounds(self) -> bool:
        """Discover the hosts, form the first round and watch the job to its end. True when it ended on
        an ``ElasticJobError``, whose text is then ``_failure``."""
        try:
            self._hosts = self._discover(first=True)
            self._form_round("job start")
            self._watch()
        except ElasticJobError as e:
            self._failure = str(e)
            return True
        return False

    def _watch(self) -> None:
        next_discovery = time.monotonic() + self._interval
        while True:
            if not self._poll():
                return
            if self._failure is not None:
                return
            if time.monotonic() >= next_discovery:
                next_discovery = time.monotonic() + self._interval
                self._rediscover()
            self._read_requests()
            self._stop_lingering_removed()
            if self._reform_reasons and not self._finishing:
                deadline = time.monotonic() + SETTLE_S
                while time.monotonic() < deadline:
                    self._collect(SETTLE_POLL_S)
                if self._failure is not None:
                    return
                if not self._finishing:
                    why, self._reform_reasons = "; ".join(dict.fromkeys(self._reform_reasons)), []
                    self._form_round(why)
            members = [self._workers[w] for w in self._book.members]
            if members and all(w.ended for w in members):
                return  # every member is done (how each ended decides the report)

    def _rediscover(self) -> None:
        try:
            hosts = self._discover(first=False)
        except ElasticJobError:
            raise
        except self.DISCOVERY_ERRORS as e:
            self._discovery_failed(e)
            return
        before = self._slots(self._hosts)
        self._hosts = hosts
        self._reform_reasons += self._book.discovery_changes(before, self._slots(hosts), self._available(),
                                                             self._is_running)

    def _read_requests(self) -> None:
        """Workers whose collective failed without anyone dying ask for a round after theirs; a
        worker whose training function returned says so (the job is finishing)."""
        if not self._finishing and self._book.finished_workers():
            self._finish()
        for wid, asked in self._book.requests():
            self._stop_absentees(asked)
            self._reform_reasons.append(f"worker {wid} asked for a new round after a failed collective")

    def _stop_absentees(self, number: int) -> None:
        """A worker gave up on round ``number``: members that never arrived in it although others
        did are hung (stopped, or stuck before init), not slow starters. They are stopped as failed,
        so the next round goes on without them."""
        absent = [self._workers[wid] for wid in self._book.absentees(number, self._is_running)
                  if self._workers[wid].removed is None]
        for w in absent:
            w.stopped_because = f"never arrived in round {number} (hung or stopped) and was stopped"
        if absent:
            self._stop_as_failed(absent, number)

    # ------------------------------------------------------------------ who holds the state

    def _is_running(self, wid: str) -> bool:
        w = self._workers.get(wid)
        return w is not None and not w.ended

    def _holders(self) -> set[str]:
        return self._book.holders()

    def _surviving_holders(self) -> list[str]:
        return self._book.surviving_holders(lambda wid: self._is_running(wid) and self._workers[wid].removed is None)

    # ------------------------------------------------------------------ the driver's own

    def _poll(self) -> bool:
        """One pass's wait for the workers' ends (and whatever else the driver does each pass);
        False ends the loop (a signal)."""
        raise NotImplementedError

    def _collect(self, timeout: float) -> None:
        """Take the workers' ends reported within ``timeout`` s."""
        raise NotImplementedError

    def _discover(self, *, first: bool) -> Any:
        raise NotImplementedError

    def _discovery_failed(self, error: BaseException) -> None:
        """A later discovery failed: say so; the last host list stays."""
        raise NotImplementedError

    def _slots(self, hosts: Any) -> list[str]:
        raise NotImplementedError

    def _available(self) -> list[str]:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _stop_lingering_removed(self) -> None:
        raise NotImplementedError

    def _stop_as_failed(self, workers: Sequence[Any], number: int) -> None:
        """Stop ``workers``, which never arrived in round ``number``, as failed."""
        raise NotImplementedError

    def _form_round(self, why: str) -> None:
        raise NotImplementedError


__all__ = ["SETTLE_S", "ElasticLoop", "ElasticWorker"]
