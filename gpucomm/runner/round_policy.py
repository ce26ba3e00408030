"""How an elastic driver forms its rounds, shared by gpucomm-run's (``elastic_driver.py``: processes)
and gpucomm.ray's (``gpucomm/ray/elastic_driver.py``: actors): the limits, the choice of members,
the waiting for enough of them, and what a round publishes in the store (``bootstrap.rounds``).

A driver keeps its workers; this module sees them only through the callables it is given
(``running(wid)``: the slot's latest worker has not ended).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..bootstrap import rounds
from ..bootstrap.placement import Placement
from ..bootstrap.rendezvous import RendezvousServer
from ..errors import ElasticJobError


@dataclass(frozen=True)
class ElasticLimits:
    """An elastic job's limits: workers at least and at most, how long to wait for them, how many
    re-forms are allowed (None: no limit)."""

    min_np: int
    max_np: int | None
    elastic_timeout: float
    reset_limit: int | None


@dataclass(frozen=True)
class LimitNames:
    """How the user gave the limits, as error messages name them."""

    min_np: str
    max_np: str
    elastic_timeout: str
    reset_limit: str


RUN_FLAGS = LimitNames("--min-np", "--max-np", "--elastic-timeout", "--reset-limit")  # gpucomm-run
RAY_ARGUMENTS = LimitNames("min_num_proc", "max_num_proc", "elastic_timeout", "reset_limit")  # gpucomm.ray


class RoundBook:
    """The rounds one driver formed (their number, the re-forms, the members in rank order, the first
    round's members) and the store they are published in."""

    def __init__(self, limits: ElasticLimits, names: LimitNames, server: RendezvousServer, run_id: str) -> None:
        self.limits, self.names = limits, names
        self.server, self.run_id = server, run_id
        self.number = 0
        self.resets = 0
        self.members: list[str] = []  # worker ids of the current round, in rank order
        self.first_members: set[str] = set()  # round 1: everyone starts from the same state

    def count_reset(self, why: str) -> None:
        """A re-form (any round after the first) counts against the reset limit: raise past it."""
        if self.number == 0:
            return
        limit = self.limits.reset_limit
        if limit is not None and self.resets >= limit:
            raise ElasticJobError(f"the job had to be re-formed again ({why}) but it was already re-formed "
                                  f"{self.resets} time(s), the {self.names.reset_limit}. Look at the causes above; "
                                  f"raise {self.names.reset_limit} to tolerate more changes.")
        self.resets += 1

    def holders(self) -> set[str]:
        """Workers that hold the trained state: those of the first round, and those that finished a sync
        (a slot's marks go with its worker: ``forget``)."""
        prefix = rounds.base(self.run_id) + "holds/"
        return self.first_members | {k[len(prefix):] for k in self.server.snapshot(prefix)}

    def forget(self, wid: str) -> None:
        """A new worker starts in slot ``wid`` (its host was removed and listed again, or its actor
        replaced): whatever the slot's earlier worker held or finished is not this one's. Call it before the
        new worker starts (the earlier one has ended, so no late mark of its can follow)."""
        self.first_members.discard(wid)
        for key in (rounds.holds_key(self.run_id, wid), rounds.done_key(self.run_id, wid)):
            self.server.remove(key)

    def surviving_holders(self, alive: Callable[[str], bool]) -> list[str]:
        """Members of the current round that hold the state and are still ``alive`` (running, not removed)."""
        holders = self.holders()
        return [wid for wid in self.members if wid in holders and alive(wid)]

    def choose(self, available: list[str], running: Callable[[str], bool]) -> list[str]:
        """The next members: surviving members that hold the state first (in their old rank order, so
        rank 0 holds it), then the other survivors, then new slots, up to the maximum."""
        alive = [wid for wid in self.members if wid in available and running(wid)]
        holders = self.holders()
        alive = [wid for wid in alive if wid in holders] + [wid for wid in alive if wid not in holders]
        fresh = [wid for wid in available if wid not in alive and not running(wid)]
        return (alive + fresh)[: self.limits.max_np or None]

    def wait_for_members(self, choose: Callable[[], list[str]], *, too_few: Callable[[list[str]], Exception],
                         waiting: Callable[[list[str]], None], tick: Callable[[], None]) -> list[str]:
        """``choose()`` until it gives at least the minimum, up to the elastic timeout (then ``too_few``
        is raised); ``waiting`` is told once, ``tick`` runs between tries (collect exits, rediscover)."""
        deadline = time.monotonic() + self.limits.elastic_timeout
        said = False
        while True:
            members = choose()
            if len(members) >= self.limits.min_np:
                return members
            if time.monotonic() > deadline:
                raise too_few(members)
            if not said:
                waiting(members)
                said = True
            tick()

    def waiting_note(self, have: int) -> str:
        """What a driver says while it waits for the minimum."""
        return (f"waiting up to {self.limits.elastic_timeout:g} s for {self.names.min_np} {self.limits.min_np} "
                f"slots (have {have})")

    def too_few_message(self, members: list[str], why: str) -> str:
        """The start of the error when the minimum did not come in time."""
        return (f"only {len(members)} slot(s) available ({', '.join(members) or 'none'}), fewer than "
                f"{self.names.min_np} {self.limits.min_np}, for {self.names.elastic_timeout} "
                f"{self.limits.elastic_timeout:g} s ({why}). ")

    def publish(self, members: list[str], placements: Mapping[str, Placement], removed: Iterable[tuple[str, str]],
                previous: set[str]) -> int:
        """Publish the next round: each member's placement, each removed worker's reason, whether it
        brought new workers, then its number (which the workers poll). Returns the number."""
        self.number += 1
        number, put = self.number, self.server.put
        for wid, p in placements.items():
            put(rounds.placement_key(self.run_id, number, wid), rounds.encode_placement(p))
        for wid, why in removed:
            put(rounds.placement_key(self.run_id, number, wid), rounds.encode_placement(None, why))
        if number > 1 and any(wid not in previous for wid in members):
            put(rounds.hosts_added_key(self.run_id, number), b"1")
        self.members = members
        if number == 1:
            self.first_members = set(members)
        put(rounds.round_key(self.run_id), str(number).encode())
        return number

    def finished_workers(self) -> set[str]:
        """Workers whose training function returned (training is over)."""
        return {k.rsplit("/", 1)[-1] for k in self.server.snapshot(rounds.base(self.run_id) + "done/")}

    def requests(self) -> list[tuple[str, int]]:
        """Members that asked for a round after the current one (a collective failed without anyone
        dying), with the round they gave up on."""
        prefix = rounds.base(self.run_id) + "want/"
        asks = []
        for key, value in self.server.snapshot(prefix).items():
            try:
                asked = int(value)
            except ValueError:
                continue
            if asked >= self.number and key[len(prefix):] in self.members:
                asks.append((key[len(prefix):], asked))
        return asks

    def absentees(self, number: int, running: Callable[[str], bool]) -> list[str]:
        """Members of round ``number`` still running that never arrived in it although others did
        (hung or stopped, not slow starters)."""
        arrived = {int(k.rsplit("/", 1)[-1]) for k in self.server.snapshot(f"{self.run_id}/e{number}/arrive/")}
        if not arrived:
            return []
        return [wid for rank, wid in enumerate(self.members) if rank not in arrived and running(wid)]

    def discovery_changes(self, before: list[str], now: list[str], available: list[str],
                          running: Callable[[str], bool]) -> list[str]:
        """Reasons to re-form after a discovery: members no longer listed, slots added or free again (while
        there is room). A slot free again is one listed but left out because its earlier worker was still
        running (removed, and still leaving, when its host was listed again): once that worker has exited it
        can take a new one, which no discovery would report as added."""
        reasons = []
        gone = [wid for wid in self.members if wid not in now and running(wid)]
        room = (self.limits.max_np or 10**9) - len(self.members)
        usable = [s for s in now if s not in self.members and s in available and not running(s)]
        added = [s for s in usable if s not in before]
        free_again = [s for s in usable if s in before]
        if gone:
            reasons.append(f"discovery no longer lists {', '.join(sorted(gone))}")
        if added and room > 0:
            reasons.append(f"discovery added {', '.join(added[:room])}")
        free_again = free_again[:max(room - len(added), 0)]
        if free_again:
            reasons.append(f"slot{'s' if len(free_again) > 1 else ''} {', '.join(free_again)} listed and free again "
                           f"(the worker removed from it has exited)")
        return reasons


def state_lost(why: str) -> ElasticJobError:
    """The error when no worker of the last round that holds the trained state is left."""
    return ElasticJobError(f"no worker that holds the trained state survives ({why}): the workers of the last round "
                           f"that finished a sync are all gone, so there is no state to hand to new workers.")


__all__ = ["ElasticLimits", "LimitNames", "RAY_ARGUMENTS", "RUN_FLAGS", "RoundBook", "state_lost"]
