"""The driver of an elastic job on Ray: gpucomm's elastic rounds with Ray actors as the workers.

The rounds are those of ``gpucomm-run``'s elastic launcher (``gpucomm.bootstrap.rounds``: the
workers' side, ``hvd.elastic.run``, is the same code): the driver describes each membership of
the job as a round in the store it serves, and forms a new one when

* a worker fails (its actor died, or its function raised): its slot is left out for the rest of
  the job. On Ray the slot, not the whole host, is left out: Ray tracks its nodes' health itself,
  and a node it loses leaves discovery;
* discovery adds or drops hosts or slots;
* a worker asks for one (a collective failed although nobody died).

Surviving workers restore their last commit and join the new round with new ranks; removed
workers return from their function and are stopped. The job ends when every worker of the round
has returned, and fails, naming the cause, when fewer than ``min_num_proc`` slots remain for
``elastic_timeout`` seconds, when the job was re-formed more than ``reset_limit`` times, or when
no worker that holds the trained state survives. Every actor started is stopped at the end.

A slot is ``<node ip>:<index>``; a worker is placed on its node with the node's ``node:<ip>``
resource. With GPUs each worker sees the GPU Ray gave it (gpucomm pins a rank to its one visible
GPU): a worker's place on its node changes from round to round, its CUDA devices cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import RayError, RayTaskError

from ..bootstrap import rounds
from ..bootstrap.launch_env import elastic_worker_env
from ..bootstrap.placement import place
from ..errors import ElasticJobError
from ..runner.elastic_loop import ElasticLoop
from ..runner.round_policy import RAY_ARGUMENTS, ElasticLimits, RoundBook, state_lost
from .layout import ActorInfo
from .ray_logger import LogPump
from .stopping import stop_actors
from .store import DriverStore
from .worker import BaseGpucommWorker, Removed

DISCOVERY_INTERVAL_S = 1.0
REMOVED_GRACE_S = 30.0  # a removed worker that has not returned by itself is stopped after this long
POLL_S = 0.1


@dataclass
class ActorShape:
    """What each worker actor holds."""

    cpus: float
    gpus: float


@dataclass
class _Worker:
    number: int  # in start order, never reused
    wid: str  # the slot: node ip:index
    host: str
    actor: Any
    info: ActorInfo | None = None
    future: Any = None
    ended: bool = False
    result: Any = None
    error: BaseException | None = None  # what its function raised
    trace: str = ""  # its traceback, as text
    why: str | None = None  # how it ended, when it failed
    removed: str | None = None
    removed_at: float = 0.0
    stopped_because: str | None = None


class ElasticRayDriver(ElasticLoop):
    """Runs one elastic job to its end: ``run(fn)`` returns the final round's results by rank."""

    def __init__(self, discovery: Any, limits: ElasticLimits, store: DriverStore, pump: LogPump, *,
                 shape: ActorShape, env: Mapping[str, str], start_timeout: float,
                 executable: tuple[type | None, Sequence[Any], Mapping[str, Any]] = (None, (), {}),
                 say: Callable[[str], None] = print, verbose: bool = False,
                 discovery_interval: float = DISCOVERY_INTERVAL_S) -> None:
        self._discovery = discovery
        self._limits = limits
        self._store = store
        self._pump = pump
        self._shape = shape
        self._env = dict(env)
        self._start_timeout = start_timeout
        self._executable = executable
        self._say_to = say
        self._verbose = verbose
        self._interval = discovery_interval
        self._actor_cls = ray.remote(BaseGpucommWorker)
        self._workers: dict[str, _Worker] = {}  # the latest worker of each slot
        self._started: list[_Worker] = []
        self._book = RoundBook(limits, RAY_ARGUMENTS, store.server, store.run_id)  # the rounds and their members
        self._hosts: dict[str, int] = {}
        self._blacklist: dict[str, str] = {}  # slot -> why
        self._reform_reasons: list[str] = []
        self._finishing = False
        self._failure: str | None = None
        self._failed_worker: _Worker | None = None  # the worker that _failure names, where one does
        self._fn: Callable[[Any], Any] | None = None
        self.leftover_pids: list[int] = []  # worker processes on this node still alive after the job
        self._callbacks: Sequence[Callable[[Any], Any]] = ()

    # ------------------------------------------------------------------ public

    def run(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run ``fn(executable)`` elastically on the workers; their results by final rank."""
        self._fn, self._callbacks = fn, list(callbacks or ())
        try:
            self._run_rounds()
            if self._failure is not None:
                self._store.server.put(rounds.fatal_key(self._store.run_id), self._failure.encode())
        except BaseException:
            self._store.server.put(rounds.fatal_key(self._store.run_id), b"the driver was interrupted")
            raise
        finally:
            self.leftover_pids = self.stop()
            self._pump.poll(self._callbacks, final=True)
        return self._report()

    def stop(self) -> list[int]:
        """Stop every actor this driver started (each one's process ends with it); returns the pids
        on this node still alive afterwards (none, normally)."""
        return stop_actors([w.actor for w in self._started], self.actor_pids)

    @property
    def actor_pids(self) -> list[tuple[str, int]]:
        """``(node ip, pid)`` of every worker that started."""
        return [(w.info.node_ip, w.info.pid) for w in self._started if w.info is not None]

    # ------------------------------------------------------------------ the loop

    def _poll(self) -> bool:
        self._collect(POLL_S)
        self._pump.poll(self._callbacks)
        return True

    def _collect(self, timeout: float) -> None:
        """Take the ends of the workers whose function returned, raised or died meanwhile."""
        running = {w.future: w for w in self._workers.values() if w.future is not None and not w.ended}
        if not running:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout)
        for ref in ready:
            self._ended(running[ref], ref)

    def _ended(self, w: _Worker, ref: Any) -> None:
        w.ended = True
        try:
            value = ray.get(ref)
        except RayTaskError as e:
            w.error = e.cause if e.cause is not None else e
            w.trace = getattr(e, "traceback_str", "") or str(e)
            w.why = f"raised {type(w.error).__name__}: {str(w.error).strip().splitlines()[0] if str(w.error) else ''}"
            self._kill(w)
        except RayError as e:  # died, or unreachable (and maybe alive, holding its resources): stopped either way
            lines = str(e).strip().splitlines()
            w.why = w.stopped_because or f"died ({lines[0] if lines else type(e).__name__})"
            self._kill(w)
        else:
            if isinstance(value, Removed):
                self._say(f"worker {w.number} ({w.wid}) left the job: {value.why}")
                self._kill(w)
                return
            w.result = value
            if w.removed is None and not self._finishing:
                self._finish()
            return
        self._failed(w)

    def _failed(self, w: _Worker) -> None:
        """``w`` ended with ``w.why`` (raised, died, or stopped as hung): its slot is left out and the job
        re-forms without it, unless it had been removed or training had finished."""
        if w.removed is not None:
            self._say(f"removed worker {w.number} ({w.wid}) {w.why}")
            return
        cause = f"worker {w.number} ({w.wid}) {w.why}"
        if self._finishing:
            self._failure, self._failed_worker = f"{cause} after training had finished on another worker", w
            return
        self._tell(f"{cause}; leaving slot {w.wid} out and re-forming the job without it")
        self._blacklist[w.wid] = cause
        self._reform_reasons.append(cause)

    def _finish(self) -> None:
        """Training has ended on some worker: no more rounds; workers started for a round that never
        formed hold no state and nobody will meet them: they are stopped."""
        self._finishing = True
        self._say("a worker finished training; waiting for the others to finish (no more re-forms)")
        done = self._book.finished_workers()
        holders = self._holders()
        for w in self._workers.values():
            if not w.ended and w.removed is None and w.wid not in done and w.wid not in holders:
                w.removed, w.removed_at = "training finished before it could join", time.monotonic()
                self._say(f"stopping worker {w.number} ({w.wid}): training finished before it could join")
                self._kill(w)

    def _discovery_failed(self, error: BaseException) -> None:
        self._tell(f"host discovery failed ({type(error).__name__}: {error}); keeping the last host list")

    def _stop_as_failed(self, workers: Sequence[_Worker], number: int) -> None:
        for w in workers:
            self._tell(f"worker {w.number} ({w.wid}) never arrived in round {number} although others did; "
                       f"stopping it as failed")
            self._kill(w)
            # ended now: ray.kill returns before the actor is gone, and the next round must not count it as a
            # survivor (its death would come too late, and cost another re-form)
            w.ended = True
            w.why = w.stopped_because or f"never arrived in round {number} and was stopped"
            self._failed(w)

    def _stop_lingering_removed(self) -> None:
        now = time.monotonic()
        for w in self._workers.values():
            if w.removed is not None and not w.ended and now - w.removed_at > REMOVED_GRACE_S:
                self._tell(f"stopping removed worker {w.number} ({w.wid}): it did not leave within "
                           f"{REMOVED_GRACE_S:g} s")
                self._kill(w)

    # ------------------------------------------------------------------ rounds

    @staticmethod
    def _slots(hosts: Mapping[str, int]) -> list[str]:
        return [f"{host}:{i}" for host, n in hosts.items() for i in range(int(n))]

    def _available(self) -> list[str]:
        return [s for s in self._slots(self._hosts) if s not in self._blacklist]

    def _form_round(self, why: str) -> None:
        """Choose the members, start the new ones, publish the round, then start their function."""
        self._book.count_reset(why)
        previous = set(self._book.members)
        if previous:
            self._check_state_survives(why)
        while True:
            members = self._wait_for_members(why, previous)
            if self._finishing:  # a worker finished training meanwhile: no more rounds
                return
            new = [wid for wid in members if not self._is_running(wid)]
            if self._start(new):
                break
        self._collect(0)  # ends that came while the actors started: the check below must see them
        if self._finishing:  # a worker finished meanwhile (_finish stopped the new ones): no round to publish
            for wid in new:  # they never got their function, so no end of theirs will come
                self._workers[wid].ended = True
            return
        if previous and not set(members) & set(self._surviving_holders()):
            raise ElasticJobError(f"no worker that holds the trained state survives ({why}).")
        placements = place([(wid, self._workers[wid].host) for wid in members])
        for wid, w in self._workers.items():
            if wid not in members and not w.ended and w.removed is None:
                w.removed, w.removed_at = self._why_removed(wid), time.monotonic()
        removed = [(wid, w.removed) for wid, w in self._workers.items() if w.removed is not None]
        number = self._book.publish(members, placements, removed, previous)
        for wid in new:
            w = self._workers[wid]
            w.future = w.actor.execute_elastic.remote(self._fn)
        self._tell(f"round {number}: {len(members)} worker(s) [{', '.join(members)}] ({why})", always=number > 1)

    def _start(self, wids: list[str]) -> bool:
        """Start a worker actor on each slot and wait until each is up; a slot whose actor cannot
        start in time is left out (False: choose the members again)."""
        starting = []
        for wid in wids:
            self._book.forget(wid)  # a slot listed again: its earlier actor's marks are not the new one's
            host = wid.rsplit(":", 1)[0]
            actor = self._actor_cls.options(num_cpus=self._shape.cpus, num_gpus=self._shape.gpus,
                                            resources={f"node:{host}": 0.001}).remote()
            w = _Worker(len(self._started), wid, host, actor)
            self._started.append(w)
            self._workers[wid] = w
            env = {**self._env, **self._store.meeting_env(),
                   **elastic_worker_env(wid, host, self._limits.elastic_timeout)}
            cls, args, kwargs = self._executable
            # its own GPU alone (none without GPUs): its local rank changes from round to round
            starting.append((w, actor.prepare.remote(env, cls, list(args), dict(kwargs), own_gpu_only=True)))
        refs = [ref for _, ref in starting]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self._start_timeout) if refs else ([], [])
        ok = True
        for w, ref in starting:
            if ref in ready:
                try:
                    w.info = ActorInfo.from_dict(ray.get(ref))
                    self._say(f"started worker {w.number} on {w.host} ({w.wid}, pid {w.info.pid})")
                    continue
                except RayTaskError as e:  # its executable_cls raised: a bug, not a lost slot
                    raise ElasticJobError(f"worker {w.number} ({w.wid}) failed to start: {e}") from e.cause
                except RayError as e:
                    why = f"could not start: {str(e).strip().splitlines()[0]}"
            else:
                why = (f"was not up within timeout_s={self._start_timeout:g} s (Ray could not place it on node "
                       f"{w.host} with {self._shape.cpus:g} CPU(s) and {self._shape.gpus:g} GPU(s): other actors may "
                       f"hold them, or the host is not a Ray node's IP)")
            w.ended, w.why = True, why
            self._kill(w)
            self._blacklist[w.wid] = f"worker {w.number} ({w.wid}) {why}"
            self._tell(f"worker {w.number} ({w.wid}) {why}; leaving the slot out")
            ok = False
        if not ok:  # the members are chosen again: those that did start were chosen as new, and are no members
            for w, _ in starting:  # yet, so they would be neither survivors nor fresh: stopped, their slots fresh
                if not w.ended:
                    self._kill(w)
                    w.ended, w.why = True, "was stopped: another slot of its round could not start"
        return ok

    def _check_state_survives(self, why: str) -> None:
        if self._surviving_holders():
            return
        if not any(not w.ended for w in self._started):
            ends = self._ends()
            also = "" if all(part in ends for part in why.split("; ")) else f" ({why})"
            raise ElasticJobError(
                f"no worker is left{also}: every worker has ended ({ends}), so nobody holds the trained state and no "
                f"new worker could start from it; waiting for hosts cannot help. Fix the workers' errors: an elastic "
                f"job survives failures only while a worker of its last round is alive.")
        raise state_lost(why)

    def _ends(self) -> str:
        return "; ".join(f"worker {w.number} ({w.wid}) " + ("removed, " if w.removed else "") + (w.why or "returned")
                         for w in self._started if w.ended)

    def _wait_for_members(self, why: str, previous: set[str]) -> list[str]:
        """Survivors that hold the state first (in their old rank order, so rank 0 holds it), then
        the other survivors, then new slots, up to max_num_proc; waits up to elastic_timeout for
        min_num_proc (and stops waiting once no worker holding the state is left)."""
        def too_few(members: list[str]) -> ElasticJobError:
            left_out = "; ".join(f"{s} ({c})" for s, c in self._blacklist.items())
            return ElasticJobError(
                self._book.too_few_message(members, why)
                + (f"Slots left out after failures: {left_out}. " if left_out else "")
                + "Add nodes to the Ray cluster, give each slot fewer resources, or lower min_num_proc.")

        def tick() -> None:
            self._collect(0.05)
            if previous:
                self._check_state_survives(why)
            time.sleep(min(self._interval, 0.5))
            try:
                self._hosts = self._discover(first=False)
            except Exception as e:  # noqa: BLE001 - keep the last good answer
                self._tell(f"host discovery failed ({type(e).__name__}: {e}); keeping the last host list")

        return self._book.wait_for_members(
            lambda: self._book.choose(self._available(), self._is_running), too_few=too_few, tick=tick,
            waiting=lambda members: self._tell(self._book.waiting_note(len(members)) + self._no_slots_hint()))

    def _no_slots_hint(self) -> str:
        if self._hosts:
            return ""
        gpus = f" and {self._shape.gpus:g} GPU(s)" if self._shape.gpus else ""
        return (f"; discovery finds no node with a whole slot ({self._shape.cpus:g} CPU(s){gpus} each) in a cluster "
                f"of {ray.cluster_resources()}: nodes with those resources must join (an autoscaler), or ask for "
                f"less per slot")

    def _why_removed(self, wid: str) -> str:
        if wid in self._blacklist:
            return f"its slot is left out ({self._blacklist[wid]})"
        if wid not in self._slots(self._hosts):
            return "host discovery no longer lists this slot"
        return f"the job already has max_num_proc {self._limits.max_np} workers"

    def _discover(self, *, first: bool) -> dict[str, int]:
        try:
            found = self._discovery.find_available_hosts_and_slots()
            return {str(h): int(n) for h, n in dict(found).items() if int(n) > 0}
        except Exception as e:
            if first:
                raise ElasticJobError(f"host discovery failed at the job's start ({type(e).__name__}: {e}); its "
                                      f"find_available_hosts_and_slots() must return {{host: slots}}.") from e
            raise

    # ------------------------------------------------------------------ helpers

    def _kill(self, w: _Worker) -> None:
        try:
            ray.kill(w.actor, no_restart=True)
        except (RayError, ValueError):
            pass

    def _say(self, message: str) -> None:
        if self._verbose:
            self._say_to(f"gpucomm.ray elastic: {message}")

    def _tell(self, message: str, always: bool = True) -> None:
        if always or self._verbose:
            self._say_to(f"gpucomm.ray elastic: {message}")

    def _report(self) -> list[Any]:
        if self._failure is not None:
            failed = self._failed_worker  # the worker the failure names; else the first that raised
            raised = (failed if failed.error is not None else None) if failed is not None else \
                next((w for w in self._started if w.error is not None), None)
            trace = (f"\n\nTraceback of worker {raised.number} ({raised.wid}):\n{raised.trace.rstrip()}"
                     if raised else "")
            raise ElasticJobError(f"gpucomm.ray: the elastic job failed: {self._failure}{trace}") \
                from (raised.error if raised else None)
        members = [self._workers[wid] for wid in self._book.members]
        bad = [w for w in members if w.why is not None and w.removed is None]
        if bad:
            raise ElasticJobError(f"gpucomm.ray: the elastic job failed: worker {bad[0].number} ({bad[0].wid}) "
                                  f"{bad[0].why}") from bad[0].error
        self._say(f"elastic job finished: round {self._book.number}, {len(members)} worker(s), re-formed {self._book.resets} "
                  f"time(s)")
        return [w.result for w in members if w.removed is None]


__all__ = ["ActorShape", "ElasticRayDriver"]
