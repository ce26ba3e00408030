"""The coordinator's bookkeeping (it lives in rank 0): which rank submitted what, and what runs next.

Pure state, no sockets and no threads, so every rule is unit-tested directly. Ranks submit
``Item``s (a full request, or a response-cache hit that stands for the request they sent last time
under that name); once every member of an operation's process set has submitted it (or has
joined), the coordinator checks that the ranks agree and emits one response — run, error, join,
barrier, or a process-set change — to the ranks concerned. Responses leave in one order, so every
rank executes its collectives in the same order.

Wire shapes (pickled, so kept to tuples of plain values):

* rank → coordinator: ``("req", set_id, name, Descriptor, payload)``, ``("hit", cache_id,
  payload)``, or ``("bits", ids)``: one bit per cached request without payload (Horovod's response
  cache: a frame's size does not grow with the number of cached operations); ``payload`` is
  None, or a small CPU allreduce's input bytes (see ``reduce_inline``)
* coordinator → rank: ``("run", set_id, name, cache_id, meta | None, result)`` (meta None: same as
  last time for this cache id; ``result``: the reduced bytes when every member sent its payload,
  so the collective is already done), ``("bits", ids)``: cached operations whose answer is the
  same as last time, run in increasing cache id, ``("error", set_id, name, message)``,
  ``("done", set_id, name, value)`` for barrier/join/process-set changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .negotiation import CONTROL_KINDS, Descriptor, disagreement, joined_disagreement
from ..errors import ProtocolError

Key = tuple[int, str]  # (process set id, op name)
Outgoing = tuple[tuple[int, ...], tuple]  # (destination ranks, response)

DEFAULT_CACHE_CAPACITY = 1024


@dataclass
class _Pending:
    kind: str
    first_seen: float
    descriptors: dict[int, Descriptor] = field(default_factory=dict)
    payloads: dict[int, bytes | None] = field(default_factory=dict)
    hit: bool = True  # every submission so far was a cache hit


@dataclass
class _CacheEntry:
    key: Key
    descriptors: dict[int, Descriptor]
    meta: Any = None


class Coordinator:
    """Negotiation state for one job: pending operations, joined ranks, process sets, response cache."""

    def __init__(self, size: int, *, cache_capacity: int = DEFAULT_CACHE_CAPACITY,
                 process_sets: Iterable[Sequence[int]] = (), clock: Callable[[], float] = time.monotonic,
                 observer: Any = None, reduce_inline: Callable[..., bytes] | None = None) -> None:
        self.size = size
        self.sets: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._next_set_id = 1
        for ranks in process_sets:
            self.sets[self._next_set_id] = tuple(ranks)
            self._next_set_id += 1
        self._pending: dict[Key, _Pending] = {}
        self._joined: list[int] = []  # in order of joining; global, as in Horovod
        self._gone: dict[int, str] = {}  # ranks that left (shut down or lost), and why
        self._cache: dict[int, _CacheEntry] = {}
        self._cache_ids: dict[Key, int] = {}
        self._capacity = cache_capacity
        self._clock = clock
        self._reduce_inline = reduce_inline  # (descriptor, payloads in rank order, set size) -> result bytes
        self.observer = observer  # the timeline (rank 0): negotiate_start / negotiate_rank_ready / negotiate_end
        self.responses = 0  # how many responses were emitted (benchmarks read it)
        self._blocked: dict[int, Key] = {}  # rank -> the pending operation its caller has been blocked on
        self._in_step: dict[int, tuple[str, float]] = {}  # rank -> the DistributedOptimizer step its caller
        # blocks in, and since when (the coordinator's clock)
        self._deadlocked_since: dict[int, float] = {}  # process set -> when all its members were last seen blocked

    # ------------------------------------------------------------------ submissions

    def submit(self, rank: int, items: Sequence[tuple]) -> list[Outgoing]:
        """Record ``rank``'s new submissions; return the responses that became possible, in order."""
        touched: list[Key] = []
        self._blocked.pop(rank, None)  # it submits again: its caller is no longer blocked
        self._in_step.pop(rank, None)
        for item in _expand_bits(items):
            key, descriptor, hit = self._resolve(rank, item)
            payload = item[-1] if item[0] in ("req", "hit") else None
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = _Pending(descriptor.kind, self._clock())
                if self.observer is not None:
                    self.observer.negotiate_start(key[1], descriptor.kind)
            if rank in pending.descriptors:
                raise ProtocolError(f"rank {rank} submitted '{key[1]}' twice while it was in flight")
            pending.descriptors[rank] = descriptor
            pending.payloads[rank] = payload
            pending.hit = pending.hit and hit
            if self.observer is not None and not hit:
                self.observer.negotiate_rank_ready(key[1], rank)
            if descriptor.kind == "join":
                if rank not in self._joined:
                    self._joined.append(rank)
                touched.extend(self._pending)  # a join can complete anything pending
            else:
                touched.append(key)
        return _coalesce(self._complete(dict.fromkeys(touched)))

    def note_blocked(self, rank: int, key: Key) -> None:
        """``rank``'s caller has been waiting on ``key`` for a while (it submits nothing meanwhile)."""
        pending = self._pending.get(key)
        if pending is not None and rank in pending.descriptors:
            self._blocked[rank] = key

    def note_in_step(self, rank: int, what: str | None) -> None:
        """``rank``'s caller blocks in a DistributedOptimizer step's transfers (``what``; None: no longer).
        A step is never negotiated, so its wait is not counted as a deadlock here (its transfers may still
        be moving, in Gloo's threads, while the rank waits); the stall warning names it."""
        if what is None:
            self._in_step.pop(rank, None)
        elif rank not in self._in_step:
            self._in_step[rank] = (what, self._clock())

    def now(self) -> float:
        """The coordinator's clock (the times it records are on it)."""
        return self._clock()

    def in_step(self) -> dict[int, tuple[str, float]]:
        """The ranks whose callers block in a DistributedOptimizer step now: which, and since when."""
        return dict(self._in_step)

    def deadlocks(self, grace: float = 0.5) -> list[Outgoing]:
        """Errors for every process set whose members all wait on operations that lack some member:
        no member can submit what the others wait for, so nothing will ever complete (different names
        per rank, or ranks waiting in different orders). Each waiting rank gets the error for its own
        operation, naming what every member waits in."""
        out: list[Outgoing] = []
        self._blocked = {r: k for r, k in self._blocked.items() if k in self._pending}
        by_set: dict[int, dict[int, Key]] = {}
        for rank, key in self._blocked.items():
            by_set.setdefault(key[0], {})[rank] = key
        now = self._clock()
        for set_id in list(self._deadlocked_since):
            if set_id not in by_set:
                del self._deadlocked_since[set_id]
        for set_id, waits in by_set.items():
            members = [r for r in self.sets.get(set_id, ()) if r not in self._joined]
            if len(members) < 2 or any(r not in waits for r in members):
                self._deadlocked_since.pop(set_id, None)
                continue
            if now - self._deadlocked_since.setdefault(set_id, now) < grace:
                continue  # every member blocked: still so after ``grace`` s means nobody will submit
            del self._deadlocked_since[set_id]
            sides = "; ".join(f"rank {r} waits in '{waits[r][1]}' (submitted by "
                              f"{_ranks(sorted(self._pending[waits[r]].descriptors))})" for r in members)
            message = (f"The ranks wait for collectives that can never complete: {sides}. Every rank must run the "
                       f"same collectives under the same names; a name built from per-rank data (an object's repr, "
                       f"a rank-dependent counter) or a different order of blocking calls on different ranks "
                       f"deadlocks. Name collectives with stable strings, in the same order on every rank.")
            for key in dict.fromkeys(waits[r] for r in members):
                out.append((tuple(sorted(self._pending[key].descriptors)), ("error", key[0], key[1], message)))
                self._finish(key)
            for r in members:
                self._blocked.pop(r, None)
        return _coalesce(out)

    def expire_clashes(self, grace: float) -> list[Outgoing]:
        """Errors for every name under which the members split between collective types: each member
        submitted exactly one of them, every member submitted one, and it has lasted ``grace`` s. A
        rank that submitted several types under one name (asynchronous ops, legal) or a member that
        has not arrived yet (it may be late) keeps the operations waiting."""
        now, out = self._clock(), []
        if len(self._pending) < 2:
            return out
        by_base: dict[tuple[int, str], dict[str, Key]] = {}  # (set, name w/o kind prefix) -> kind -> key
        for key, pending in self._pending.items():
            base = _base_name(key) if pending.kind not in CONTROL_KINDS else None
            if base is not None:
                by_base.setdefault(base, {})[pending.kind] = key
        for base, kinds in by_base.items():
            if len(kinds) < 2:
                continue
            if now - max(self._pending[key].first_seen for key in kinds.values()) < grace:
                continue  # the clash began when its last type arrived
            submitters = [set(self._pending[key].descriptors) for key in kinds.values()]
            everyone = set().union(*submitters)
            members = {r for r in self._members(base[0]) if r not in self._joined}
            if sum(map(len, submitters)) != len(everyone) or not members <= everyone:
                continue  # a rank used two types, or a member is still to come: not (yet) a mismatch
            sides = "; ".join(f"{_ranks(sorted(self._pending[key].descriptors))} called {kind}"
                              for kind, key in kinds.items())
            message = (f"Mismatched collective types under the name '{base[1]}': {sides}. Every rank must run the "
                       f"same collective under one name; ranks calling hvd.{' / hvd.'.join(kinds)} with name="
                       f"'{base[1]}' cannot meet.")
            for key in kinds.values():
                ranks = tuple(sorted(self._pending[key].descriptors))
                self._finish(key)
                out.append((ranks, ("error", key[0], key[1], message)))
        return _coalesce(out)

    def _resolve(self, rank: int, item: tuple) -> tuple[Key, Descriptor, bool]:
        if item[0] == "hit":
            entry = self._cache.get(item[1])
            if entry is None or rank not in entry.descriptors:
                raise ProtocolError(f"rank {rank} sent unknown cache id {item[1]!r}")
            return entry.key, entry.descriptors[rank], True
        if item[0] == "req":
            _, set_id, name, descriptor, _payload = item
            if set_id not in self.sets:
                raise ProtocolError(f"rank {rank} used process set {set_id}, which does not exist")
            return (set_id, name), descriptor, False
        raise ProtocolError(f"rank {rank} sent an item of unknown type {item[0]!r}")

    def _members(self, set_id: int) -> tuple[int, ...]:
        return self.sets[set_id]

    def _complete(self, keys: Iterable[Key]) -> list[Outgoing]:
        out: list[Outgoing] = []
        for key in keys:
            pending = self._pending.get(key)
            if pending is None:
                continue
            set_id, name = key
            members = self.sets.get(set_id, ())
            if pending.kind == "join":
                gone = [r for r in range(self.size) if r not in self._joined and r in self._gone]
                if gone:
                    self._finish(key)
                    out.append((tuple(range(self.size)), ("error", set_id, name, "join() cannot complete: "
                                                          + "; ".join(self._gone[r] for r in gone))))
                    continue
                if len(self._joined) < self.size:
                    continue
                out.append((tuple(range(self.size)), ("done", set_id, name, self._joined[-1])))
                self._joined = []
                self._finish(key)
                continue
            if len(pending.descriptors) == len(members):  # every member submitted (the common case)
                self._finish(key)
                out.append(self._respond(key, pending, members))
                continue
            absent = [r for r in members if r not in pending.descriptors and r not in self._joined]
            gone = [r for r in absent if r in self._gone]
            if gone:
                self._finish(key)
                out.append((members, ("error", set_id, name, f"{pending.kind.upper()} '{name}' cannot complete: "
                                      + "; ".join(self._gone[r] for r in gone))))
                continue
            if absent:
                continue
            self._finish(key)
            out.append(self._respond(key, pending, members))
        return out

    def rank_left(self, rank: int, reason: str) -> list[Outgoing]:
        """``rank`` will submit nothing more (it shut down, or its connection broke): fail what
        needs it, now and later; ``reason`` says what happened, naming the rank."""
        self._gone.setdefault(rank, reason)
        for pending in self._pending.values():  # what it submitted it will never run: counted as absent
            if pending.kind != "join":
                pending.descriptors.pop(rank, None)
                pending.payloads.pop(rank, None)
        return _coalesce(self._complete(list(self._pending)))

    def _finish(self, key: Key) -> None:
        self._pending.pop(key, None)
        self.responses += 1
        if self.observer is not None:
            self.observer.negotiate_end(key[1])

    def _respond(self, key: Key, pending: _Pending, members: tuple[int, ...]) -> Outgoing:
        set_id, name = key
        descriptors = pending.descriptors
        # Cache hits from every rank stand for the combination validated when the entry was last used.
        error = None if pending.hit and key in self._cache_ids else disagreement(name, descriptors)
        joined = tuple(r for r in members if r in self._joined and r not in descriptors) if self._joined else ()
        if error is None and joined:
            error = joined_disagreement(name, pending.kind, next(iter(descriptors.values())).op, joined)
        if error is not None:
            return members, ("error", set_id, name, error)
        if pending.kind in CONTROL_KINDS:
            return self._control(key, pending, members)
        meta = self._meta(pending.kind, members, descriptors, joined)
        cache_id = self._cache_ids.get(key)
        if cache_id is None and len(self._cache) < self._capacity and not _unnamed(name):
            cache_id = self._cache_ids[key] = len(self._cache)
            self._cache[cache_id] = _CacheEntry(key, dict(descriptors))
        result = self._inline(pending, members)
        if cache_id is None:
            return members, ("run", set_id, name, -1, meta, result)
        entry = self._cache[cache_id]
        entry.descriptors.update(descriptors)
        same = pending.hit and entry.meta == meta
        entry.meta = meta
        return members, ("run", set_id, name, cache_id, None if same else meta, result)

    def _inline(self, pending: _Pending, members: tuple[int, ...]) -> bytes | None:
        """The reduced bytes when every member that did not join sent its input with the request."""
        if self._reduce_inline is None:
            return None
        payloads, sent = [], pending.payloads
        for r in members:
            if r in sent:  # a joined rank sent nothing: it counts as zeros
                if sent[r] is None:
                    return None
                payloads.append(sent[r])
        if not payloads:
            return None
        return self._reduce_inline(next(iter(pending.descriptors.values())), payloads, len(members))

    @staticmethod
    def _meta(kind: str, members: tuple[int, ...], descriptors: dict[int, Descriptor], joined: tuple[int, ...]) -> dict:
        """What the data plane needs beyond each rank's own request: the other ranks' first
        dimensions (allgather), the matrix of splits (alltoall), who stands in with zeros."""
        meta: dict[str, Any] = {}
        if kind == "allgather":
            meta["rows"] = [[descriptors[r].shapes[i][0] if descriptors[r].shapes[i] else 1 for r in members]
                            for i in range(len(next(iter(descriptors.values())).shapes))]
        elif kind == "alltoall":
            n = len(members)
            matrix = []
            for r in members:
                d = descriptors[r]
                if d.splits is not None:
                    matrix.append(list(d.splits))
                else:
                    rows = d.shapes[0][0]
                    matrix.append([rows // n] * n)
            meta["splits"] = matrix
        if joined:
            meta["joined"] = joined
            meta["template"] = next(iter(descriptors.values()))
        return meta

    def _control(self, key: Key, pending: _Pending, members: tuple[int, ...]) -> Outgoing:
        set_id, name = key
        descriptor = next(iter(pending.descriptors.values()))
        if pending.kind == "barrier":
            return members, ("done", set_id, name, None)
        if pending.kind == "add_process_set":
            ranks = tuple(descriptor.ranks or ())
            problem = _invalid_set(ranks, self.size)
            if problem is None:
                for existing_id, existing in self.sets.items():
                    if sorted(existing) == sorted(ranks):
                        problem = (f"add_process_set({list(ranks)}): a process set with these ranks is already "
                                   f"registered (id {existing_id}); reuse it instead of adding it again.")
            if problem is not None:
                return members, ("error", set_id, name, problem)
            new_id = self._next_set_id
            self._next_set_id += 1
            self.sets[new_id] = ranks
            return members, ("done", set_id, name, (new_id, ranks))
        if pending.kind == "remove_process_set":
            target = descriptor.root
            if target == 0 or target not in self.sets:
                why = "the global process set cannot be removed" if target == 0 else "it is not registered"
                return members, ("error", set_id, name, f"remove_process_set: process set id {target}: {why}.")
            busy = sorted(n for (s, n) in self._pending if s == target)
            if busy:
                return members, ("error", set_id, name,
                                 f"remove_process_set: process set id {target} still has operations in flight "
                                 f"({', '.join(busy[:5])}); synchronize them before removing the set.")
            del self.sets[target]
            return members, ("done", set_id, name, target)
        raise ProtocolError(f"unknown control kind {pending.kind!r}")

    # ------------------------------------------------------------------ stalls and failures

    def stalled(self, older_than: float) -> list[tuple[int, str, float, list[int]]]:
        """Operations some members submitted more than ``older_than`` seconds ago while others did
        not: ``(set_id, name, age_seconds, missing_ranks)``."""
        now = self._clock()
        out = []
        for (set_id, name), pending in self._pending.items():
            age = now - pending.first_seen
            if age < older_than:
                continue
            if pending.kind == "join":
                continue  # joined ranks wait on purpose while the others finish their data (as in Horovod)
            members = self.sets.get(set_id, ())
            missing = [r for r in members if r not in pending.descriptors and r not in self._joined]
            if missing:
                out.append((set_id, name, age, missing))
        return out

    def cached_name(self, cache_id: int) -> str:
        entry = self._cache.get(cache_id)
        return entry.key[1] if entry is not None else f"cached operation {cache_id}"

    def pending_names(self) -> list[Key]:
        return list(self._pending)

    @property
    def joined(self) -> list[int]:
        return list(self._joined)


def set_bits(bits: int) -> list[int]:
    """The positions of the bits set in ``bits``, lowest first."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def _expand_bits(items: Sequence[tuple]) -> list[tuple]:
    out = []
    for item in items:
        if item[0] == "bits":
            out.extend(("hit", cache_id, None) for cache_id in set_bits(item[1]))
        else:
            out.append(item)
    return out


def _coalesce(outgoing: list[Outgoing]) -> list[Outgoing]:
    """Fold runs of cached answers that need nothing new (no metadata, no inline result) for the same
    ranks into one ``("bits", ids)`` response each; every rank runs a run's operations in id order."""
    out: list[Outgoing] = []
    for ranks, response in outgoing:
        plain = response[0] == "run" and response[3] >= 0 and response[4] is None and response[5] is None
        if plain and out and out[-1][1][0] == "bits" and out[-1][0] == ranks:
            out[-1] = (ranks, ("bits", out[-1][1][1] | (1 << response[3])))
        elif plain:
            out.append((ranks, ("bits", 1 << response[3])))
        else:
            out.append((ranks, response))
    return out


def _base_name(key: Key) -> tuple[int, str] | None:
    """``(set, name)`` without the collective's kind prefix (``allreduce.m`` -> ``m``), or None for
    names gpucomm did not prefix (control operations, the optimizer's fixed schedule)."""
    kind, dot, rest = key[1].partition(".")
    return (key[0], rest) if dot and kind in _PREFIXED_KINDS else None


_PREFIXED_KINDS = frozenset({"allreduce", "allgather", "broadcast", "alltoall", "reducescatter"})


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _unnamed(name: str) -> bool:
    """Unnamed operations get a fresh name per call (``<kind>.noname.<n>``): caching them would only
    fill the cache with names that never come back."""
    return ".noname." in name


def _invalid_set(ranks: tuple[int, ...], size: int) -> str | None:
    if not ranks:
        return "add_process_set: a process set needs at least one rank."
    if len(set(ranks)) != len(ranks):
        return f"add_process_set({list(ranks)}): a rank is listed twice."
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        return f"add_process_set({list(ranks)}): ranks {bad} are not ranks of this job (0..{size - 1})."
    return None


__all__ = ["Coordinator", "DEFAULT_CACHE_CAPACITY", "ProtocolError", "set_bits"]
