"""The launcher of an elastic job: workers come and go, the job goes on.

The driver polls host discovery, starts one worker per available slot (up to ``--max-np``), and
describes each membership of the job as a *round* in the rendezvous store it serves
(``gpucomm.elastic.rounds``). It forms a new round when

* a worker dies: its host is blacklisted and its other workers are removed (Horovod's rule);
* hosts are added or removed by discovery;
* a worker asks for one (a collective failed although nobody died).

Surviving workers tear their communicators down, join the new round with new ranks and continue
from their last commit (``hvd.elastic.run``); removed workers exit with status 0. The job ends when
every worker of the round has exited 0, and fails with a message naming the cause when fewer than
``--min-np`` slots remain for ``--elastic-timeout`` seconds, when the job had to be re-formed more
than ``--reset-limit`` times, or when no worker of the previous round survives (nobody holds the
state) -- at once, also while it waits for slots: a job with no worker left never waits for hosts.
Nothing is left running: stopping uses the same process-tree kill as the fixed launcher.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping

from ..bootstrap.launch_env import elastic_worker_env, rendezvous_env
from ..bootstrap.rendezvous import RendezvousServer
from ..bootstrap import rounds
from ..bootstrap.placement import Placement, place
from . import proctree
from .discovery import DiscoveryError
from .elastic_loop import ElasticLoop
from .hosts import HostSlots
from .output import OutputSink
from .round_policy import RUN_FLAGS, ElasticLimits, RoundBook, state_lost
from .remote import ELASTIC_SERVER_ALIVE_S
from .spawn import SshOptions, StoreAddress, launch_for
from .supervisor import Launch, describe_exit, exit_status
from ..errors import ElasticJobError

DISCOVERY_INTERVAL_S = 1.0
REMOVED_GRACE_S = 60.0  # a removed worker that has not left by itself is stopped after this long


class _Stopped(Exception):
    """A signal arrived while the driver waited for hosts."""


@dataclass
class _Worker:
    number: int  # output prefix and log name; never reused
    wid: str  # host:slot, stable across rounds
    host: str
    proc: subprocess.Popen | None = None
    exit_code: int | None = None
    removed: str | None = None  # why it was left out of the job
    removed_at: float = 0.0
    stopped_because: str | None = None  # the driver stopped it as failed (it hung)
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.exit_code is not None


class ElasticDriver(ElasticLoop):
    """Runs an elastic job to its end and returns the launcher's exit status."""

    DISCOVERY_ERRORS = (DiscoveryError,)

    def __init__(self, discovery, limits: ElasticLimits, command: list[str], base_env: Mapping[str, str],
                 tunables: Mapping[str, str], server: RendezvousServer, *, rendezvous_addr: StoreAddress,
                 secret: bytes,
                 run_id: str, sink: OutputSink, ssh: SshOptions, grace: float, verbose: bool = False,
                 discovery_interval: float = DISCOVERY_INTERVAL_S) -> None:
        self._discovery = discovery
        self._limits = limits
        self._command = command
        self._base_env = dict(base_env)
        self._tunables = dict(tunables)
        self._server = server
        self._addr = rendezvous_addr
        self._secret = secret
        self._run_id = run_id
        self._sink = sink
        # a cut host's ssh ends 15-20 s after the cut: blacklisted before the survivors ask for a new round
        self._ssh = dataclasses.replace(ssh, server_alive_s=min(ssh.server_alive_s, ELASTIC_SERVER_ALIVE_S))
        self._grace = grace
        self._verbose = verbose
        self._interval = discovery_interval
        self._workers: dict[str, _Worker] = {}  # the latest worker of each slot
        self._started: list[_Worker] = []  # every worker ever started (their output pumps are joined at the end)
        self._book = RoundBook(limits, RUN_FLAGS, server, run_id)  # the rounds formed and their members
        self._hosts: list[HostSlots] = []
        self._blacklist: dict[str, str] = {}  # host -> why
        self._events: queue.Queue[tuple[_Worker, int]] = queue.Queue()
        self._reform_reasons: list[str] = []
        self._finishing = False  # a member exited 0: training is over, no more rounds
        self._failure: str | None = None
        self._signal: int | None = None
        self._die_with_launcher = proctree.die_with_parent_hook()

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        proctree.become_subreaper()
        previous = proctree.install_stop_handlers(self._on_signal)
        try:
            try:
                if self._run_rounds():
                    self._server_set(rounds.fatal_key(self._run_id), self._failure.encode())
            except _Stopped:
                pass  # the report says which signal
        finally:
            try:
                self._stop(self._alive())
                proctree.reap_orphans({w.proc.pid for w in self._started if w.proc is not None})
            finally:
                proctree.restore_handlers(previous)
            for w in self._started:
                for t in w.pumps:
                    t.join(timeout=5)
        return self._report()

    # ------------------------------------------------------------------ the loop

    def _poll(self) -> bool:
        if self._signal is not None:
            return False
        self._collect(timeout=0.05)
        return True

    def _collect(self, timeout: float) -> None:
        try:
            w, code = self._events.get(timeout=timeout)
        except queue.Empty:
            return
        wid = w.wid
        w.exit_code = code
        if w.removed is not None:
            self._sink.say(f"removed worker {w.number} ({wid}) {describe_exit(code)}")
            return
        if code == 0:
            if not self._finishing:
                self._finish()
            return
        cause = f"worker {w.number} ({wid}) {w.stopped_because or describe_exit(code)}"
        if self._finishing:
            self._failure = f"{cause} after training had finished on another worker"
            return
        self._sink.say(f"{cause}; blacklisting host {w.host} and re-forming the job without it")
        self._blacklist[w.host] = cause
        self._reform_reasons.append(cause)

    def _drain_exits(self) -> None:
        """Take every worker exit already reported (``_collect`` takes one at a time)."""
        while not self._events.empty():
            self._collect(timeout=0)

    def _finish(self) -> None:
        """Training has ended on some worker: no more rounds. Workers started for a round that
        never formed (they hold no state and nobody will meet them) are stopped as removed."""
        self._finishing = True
        self._say("a worker finished training; waiting for the others to finish (no more re-forms)")
        done = self._book.finished_workers()
        stranded = [w for w in self._alive() if w.removed is None and w.wid not in done and w.wid not in self._holders()]
        for w in stranded:
            w.removed, w.removed_at = "training finished before it could join", time.monotonic()
        if stranded:
            self._sink.say(f"stopping {len(stranded)} worker(s) started for a round that training finished before: "
                           f"{', '.join(w.wid for w in stranded)}")
            self._stop(stranded)

    def _discovery_failed(self, error: BaseException) -> None:
        self._sink.say(f"host discovery failed ({error}); keeping the last host list")

    def _stop_as_failed(self, workers, number: int) -> None:
        self._sink.say(f"worker(s) {', '.join(w.wid for w in workers)} never arrived in round {number} although "
                       f"the others did; stopping them as failed")
        self._stop(list(workers))

    # ------------------------------------------------------------------ rounds

    def _available(self) -> list[str]:
        return [s for s in self._slots(self._hosts) if s.rsplit(":", 1)[0] not in self._blacklist]

    @staticmethod
    def _slots(hosts: list[HostSlots]) -> list[str]:
        return [f"{h.host}:{i}" for h in hosts for i in range(h.slots)]

    def _form_round(self, why: str) -> None:
        """Choose the members, start the new ones, and publish the round."""
        self._book.count_reset(why)
        previous = set(self._book.members)
        if previous:
            self._check_state_survives(why)
        members = self._wait_for_members(why, previous)
        if self._finishing:  # a worker finished training while this round waited for slots: no more rounds
            return
        if previous and not set(members) & set(self._surviving_holders()):
            raise ElasticJobError(f"no worker that holds the trained state survives ({why}).")
        new = [wid for wid in members if wid not in self._workers or self._workers[wid].exit_code is not None]
        placements = place([(wid, wid.rsplit(":", 1)[0]) for wid in members])
        for wid in new:
            self._start(wid, wid.rsplit(":", 1)[0])
        for wid, w in self._workers.items():
            if wid not in placements and w.exit_code is None and w.removed is None:
                w.removed, w.removed_at = self._why_removed(wid), time.monotonic()
        removed = [(wid, w.removed) for wid, w in self._workers.items() if w.removed is not None]
        number = self._book.publish(members, placements, removed, previous)
        self._say(f"round {number}: {len(members)} worker(s) [{', '.join(members)}] ({why})")

    def _check_state_survives(self, why: str) -> None:
        """A re-formed job continues from a worker of the last round that holds the trained state; when
        none is running any more the job cannot go on, whatever hosts may still come: end it now."""
        if self._surviving_holders():
            return
        if not self._alive():
            raise ElasticJobError(
                f"no worker is left ({why}): every worker has exited ({self._exits()}), so nobody holds the "
                f"trained state and no new worker could start from it; waiting for hosts cannot help. Look at the "
                f"workers' errors above and fix them: an elastic job survives failures only while a worker of its "
                f"last round is alive.")
        raise state_lost(why)

    def _exits(self) -> str:
        """How each worker ever started ended, in start order."""
        ended = [(w, w.exit_code if w.exit_code is not None else w.proc.poll()) for w in self._started
                 if w.proc is not None]
        return "; ".join(f"worker {w.number} ({w.wid}) " + ("removed, " if w.removed else "") + describe_exit(code)
                         for w, code in ended if code is not None)

    def _wait_for_members(self, why: str, previous: set[str]) -> list[str]:
        """Survivors that hold the state first (in their old rank order, so rank 0 holds it), then
        the other survivors, then new slots, up to --max-np; waits up to --elastic-timeout for --min-np
        (a re-form stops waiting as soon as no worker holding the state is left: ``_check_state_survives``)."""

        def too_few(members: list[str]) -> ElasticJobError:
            return ElasticJobError(
                self._book.too_few_message(members, why)
                + (f"Blacklisted hosts: {'; '.join(f'{h} ({c})' for h, c in self._blacklist.items())}. "
                   if self._blacklist else "")
                + "Add hosts through the discovery script or lower --min-np.")

        def tick() -> None:
            self._collect(timeout=0.05)
            if self._signal is not None:
                raise _Stopped()
            if previous:
                self._drain_exits()
                self._check_state_survives(why)
            time.sleep(min(self._interval, 0.5))
            try:
                self._hosts = self._discover(first=False)
            except DiscoveryError as e:
                self._sink.say(f"host discovery failed ({e}); keeping the last host list")

        return self._book.wait_for_members(lambda: self._book.choose(self._available(), self._is_running),
                                           too_few=too_few, tick=tick,
                                           waiting=lambda members: self._say(self._book.waiting_note(len(members))))

    def _why_removed(self, wid: str) -> str:
        host = wid.rsplit(":", 1)[0]
        if host in self._blacklist:
            return f"host {host} is blacklisted ({self._blacklist[host]})"
        if wid not in self._slots(self._hosts):
            return "the host discovery script no longer lists this slot"
        return f"the job already has --max-np {self._limits.max_np} workers"

    def _discover(self, *, first: bool) -> list[HostSlots]:
        try:
            return self._discovery.find()
        except DiscoveryError as e:
            if first:
                raise ElasticJobError(f"{e} Fix the script: it must print one host or host:slots per line and exit 0.")
            raise

    # ------------------------------------------------------------------ processes

    def _start(self, wid: str, host: str) -> None:
        self._book.forget(wid)  # a slot listed again: its earlier worker's marks are not the new one's
        number = len(self._started)
        env = dict(self._tunables)
        env.update(elastic_worker_env(wid, host, self._limits.elastic_timeout))
        env.update(rendezvous_env(self._addr(host), self._server.port, self._secret, self._run_id))
        launch: Launch = launch_for(Placement(host, number, 0, 0, 0, 0, 0), self._command, self._base_env, env,
                                    cwd=os.getcwd(), ssh=self._ssh, grace=self._grace)
        w = self._workers[wid] = _Worker(number, wid, host)
        self._started.append(w)
        try:
            w.proc = subprocess.Popen(
                launch.argv, env=launch.env, start_new_session=True, preexec_fn=self._die_with_launcher,
                stdin=subprocess.PIPE if launch.stdin_payload is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd())
        except OSError as e:
            raise ElasticJobError(f"worker {number} ({wid}) could not be started: {e.strerror or e}. Check the "
                                  f"command and that it is on PATH.") from None
        if launch.stdin_payload is not None:
            try:
                w.proc.stdin.write(launch.stdin_payload)
                w.proc.stdin.flush()
            except OSError:
                pass
        w.pumps = [self._sink.pump(number, "stdout", w.proc.stdout), self._sink.pump(number, "stderr", w.proc.stderr)]
        threading.Thread(target=lambda: self._events.put((w, w.proc.wait())), daemon=True,
                         name=f"worker{number}-wait").start()
        self._say(f"started worker {number} on {host} ({wid}{'' if launch.remote is False else ', ssh'}, "
                  f"pid {w.proc.pid})")

    def _alive(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.proc is not None and w.proc.poll() is None]

    def _stop_lingering_removed(self) -> None:
        late = [w for w in self._alive() if w.removed is not None and time.monotonic() - w.removed_at > REMOVED_GRACE_S]
        if late:
            self._sink.say(f"stopping {len(late)} removed worker(s) that did not leave within {REMOVED_GRACE_S:g} s")
            self._stop(late)

    def _stop(self, workers: list[_Worker]) -> None:
        """SIGTERM, the grace period, then SIGKILL of each worker's process tree."""
        if not workers:
            return
        def close_stdin(proc: subprocess.Popen) -> None:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()  # a remote wrapper takes EOF as "terminate"
                except OSError:
                    pass

        stuck = proctree.stop_and_reap([w.proc for w in workers], self._grace, close_stdin=close_stdin)
        for w in workers:
            if w.proc in stuck:
                self._sink.say(f"worker {w.number} (pid {w.proc.pid}) did not exit even after SIGKILL")

    # ------------------------------------------------------------------ signals, store, report

    def _on_signal(self, signum: int, _frame) -> None:
        if self._signal is None:
            self._signal = signum

    def _server_set(self, key: str, value: bytes) -> None:
        self._server.put(key, value)

    def _say(self, message: str) -> None:
        if self._verbose or message.startswith(("round", "worker", "waiting")):
            self._sink.say(message)

    def _report(self) -> int:
        if self._failure is not None:
            self._sink.say(f"elastic job failed: {self._failure}")
            return 1
        if self._signal is not None:
            self._sink.say(f"received {signal.Signals(self._signal).name}; stopped every worker")
            return 128 + self._signal
        members = [self._workers[w] for w in self._book.members]
        bad = [w for w in members if w.exit_code not in (0, None) and w.removed is None]
        if bad:
            w = bad[0]
            self._sink.say(f"elastic job failed: worker {w.number} ({w.wid}) {describe_exit(w.exit_code)}")
            return exit_status(w.exit_code)
        self._say(f"elastic job finished: round {self._book.number}, {len(members)} worker(s), re-formed {self._book.resets} "
                  f"time(s)")
        return 0


def make_limits(np: int, min_np: int | None, max_np: int | None, elastic_timeout: float | None,
                reset_limit: int | None, env: Mapping[str, str]) -> ElasticLimits:
    """Horovod's defaults: --min-np defaults to -np, --max-np is unbounded, the timeout is 600 s
    (or HOROVOD_ELASTIC_TIMEOUT)."""
    timeout = elastic_timeout or rounds.elastic_timeout(env)
    low = min_np if min_np is not None else np
    if max_np is not None and max_np < low:
        raise ValueError(f"--max-np {max_np} is smaller than --min-np {low}")
    return ElasticLimits(low, max_np, timeout, reset_limit)


__all__ = ["ElasticDriver", "ElasticJobError", "ElasticLimits", "make_limits"]
