"""Rank 0's side of the control plane: the coordinator, one authenticated channel per other rank,
who has left and why, and the stall inspector. It turns frames from the other ranks into
coordinator submissions and sends every response to the ranks it concerns (one frame per rank);
rank 0's own responses go to ``apply``."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from . import channel
from .config import ControlConfig
from .coordinator import Coordinator, Outgoing, set_bits
from .liveness import Liveness
from .stalls import StallInspector

log = logging.getLogger("gpucomm.control")


CLASH_GRACE = 1.0  # s two collective types may stay pending under one name before it is an error


class CoordinatorHub:
    """``apply(response)`` runs one of rank 0's own responses; ``stopping()`` is true once rank 0
    shuts down (a lost rank is then no failure); ``failed()`` once the job has failed."""

    def __init__(self, size: int, coordinator: Coordinator, workers: Mapping[int, Any], config: ControlConfig, *,
                 apply: Callable[[tuple], None], stopping: Callable[[], bool], failed: Callable[[], bool],
                 hosts: tuple[str, ...] = ()) -> None:
        self.size = size
        self._hosts = hosts  # the host each rank runs on (errors name it)
        self.coordinator = coordinator
        self._workers = dict(workers)
        self._rank_of = {c.sock: r for r, c in self._workers.items()}
        self._apply, self._stopping, self._failed = apply, stopping, failed
        self.left: set[int] = set()  # ranks whose connections ended
        self._failed_reports: dict[int, str] = {}  # ranks that reported a failure before leaving
        self.frames_received = 0
        self.liveness = Liveness(self._workers, config.liveness_timeout) if config.liveness_timeout else None
        self._deadlock_check = config.deadlock_check
        self._last_sent: dict[int, list] = {}  # rank -> the responses last sent to it (what it was told to run)
        self.stalls = None
        if config.stall_warning is not None:
            self.stalls = StallInspector(coordinator, config.stall_warning, config.stall_shutdown,
                                         report=self._send_stall_info, abort=self.abort_all)

    def sockets(self) -> list:
        return [c.sock for r, c in self._workers.items() if r not in self.left]

    def everyone_left(self) -> bool:
        return len(self.left) >= len(self._workers)

    def submit_own(self, items: list[tuple]) -> None:
        """Rank 0's own requests."""
        self.dispatch(self.coordinator.submit(0, items))

    def receive(self, sock: Any) -> None:
        """Read one frame from the rank behind ``sock`` and act on it."""
        rank = self._rank_of.get(sock)
        if rank is None or rank in self.left:
            return
        try:
            items = channel.recv(self._workers[rank])
        except (OSError, channel.FrameError, EOFError) as e:
            self.lost(rank, f"its control connection closed ({e or 'end of stream'})")
            return
        self.frames_received += 1
        if self.liveness is not None:
            self.liveness.heard(rank)
        requests = []
        for item in items:
            if item[0] == "hb":
                continue
            if item[0] == "blocked":
                self.coordinator.note_blocked(rank, (item[1], item[2]))
                continue
            if item[0] == "in_step":
                self.coordinator.note_in_step(rank, item[1])
                continue
            if item[0] == "bye":
                self.left.add(rank)
                if self.liveness is not None:
                    self.liveness.forget(rank)
                self.dispatch(self.coordinator.rank_left(rank, f"rank {rank} has shut gpucomm down"))
                self.tell_left(rank, item[1] if len(item) > 1 else ())
            elif item[0] == "fail":
                self._failed_reports.setdefault(rank, item[1])
                self.abort_all(f"rank {rank} failed: {item[1]}")
            else:
                requests.append(item)
        if requests:
            try:
                self.dispatch(self.coordinator.submit(rank, requests))
            except Exception as e:  # a protocol violation: the job cannot go on consistently
                self.abort_all(f"rank {rank} sent a request the coordinator cannot accept: {e}")

    def tell_left(self, rank: int, launched: tuple = ()) -> None:
        """Tell every rank still here, rank 0 included, that ``rank`` shut gpucomm down, with ``launched``: how
        many collectives of each fixed schedule it launched (``(set id, number, launches)`` triples). One it
        never launched then fails naming it, instead of a bare transport error or a timeout. Not kept as
        what a rank was last told to run (``_last_sent``: a silent rank's report names that)."""
        others = [r for r in self._workers if r not in self.left and r != rank]
        message = ("left", rank, tuple(launched))
        for r in others:
            try:
                channel.send(self._workers[r], [message])
            except OSError as e:
                self.lost(r, f"sending to it failed: {e}")
        if rank != 0:
            self._apply(message)

    def lost(self, rank: int, what: str) -> None:
        if rank in self.left:
            return
        self.left.add(rank)
        self._workers[rank].sock.close()
        if self._stopping():
            return
        cause = self._failed_reports.get(rank)
        self.abort_all(f"rank {rank} failed: {cause}" if cause else
                       f"rank {rank} exited or crashed without shutting gpucomm down ({what}; it ran"
                       f"{self._on(rank) or ' on an unnamed host'})")

    def dispatch(self, outgoing: list[Outgoing]) -> None:
        """Send each response to its ranks (one frame per rank) and apply rank 0's own."""
        frames: dict[int, list] = {}
        mine = []
        for ranks, response in outgoing:
            for r in ranks:
                if r == 0:
                    mine.append(response)
                elif r not in self.left:
                    frames.setdefault(r, []).append(response)
        for r, responses in frames.items():
            self._last_sent[r] = responses
            try:
                channel.send(self._workers[r], responses)
            except OSError as e:
                self.lost(r, f"sending to it failed: {e}")
        for response in mine:
            self._apply(response)

    def beat(self) -> None:
        """One heartbeat to every rank still here (from the beating thread; needs no control lock)."""
        for r, chan in list(self._workers.items()):
            if r not in self.left:
                try:
                    channel.send(chan, [("hb",)])
                except OSError:
                    pass  # reading from it reports the broken connection

    def check_liveness(self) -> None:
        """End the job if a rank has been silent for too long."""
        liveness = self.liveness
        if liveness is None:
            return
        silent = [(r, s) for r, s in liveness.silent() if r not in self.left]
        if silent:
            rank, seconds = silent[0]
            liveness.forget(rank)
            # ranks that missed a beat too: on the same cut host, they cross the limit a beat later
            quiet = [f"rank {r}{self._on(r)} for {s:.0f} s" for r, s in liveness.quiet_for(2 * liveness.interval)
                     if r != rank and r not in self.left]
            also = f"; also silent: {', '.join(quiet)}" if quiet else ""
            self.abort_all(f"rank {rank} stopped responding: nothing heard from rank {rank}{self._on(rank)} for "
                           f"{seconds:.0f} s ({self._where(rank)}{also}). Likely causes: the process was stopped "
                           f"(SIGSTOP, a debugger), its host froze or lost the network (a cut link, a partition), or "
                           f"it hangs in a call that holds the GIL. GPUCOMM_LIVENESS_TIMEOUT sets this limit (0 turns "
                           f"the check off).")

    def _on(self, rank: int) -> str:
        """`` on HOST`` for ``rank`` when its host is known."""
        return f" on {self._hosts[rank]}" if 0 <= rank < len(self._hosts) else ""

    def _where(self, rank: int) -> str:
        """The collective ``rank`` was in: one the others wait for it to submit, or the last it was told to run."""
        waiting = [name for _, name, _, missing in self.coordinator.stalled(0.0) if rank in missing]
        if waiting:
            return f"the other ranks wait for it in {', '.join(waiting[:3])}"
        names = []
        for response in self._last_sent.get(rank, ()):
            if response[0] == "run":
                names.append(response[2])
            elif response[0] == "bits":
                names += [self.coordinator.cached_name(i) for i in set_bits(response[1])]
        return f"it was last told to run {', '.join(names[-3:])}" if names else "before its first collective"

    def check_clashes(self) -> None:
        """Fail operations that have met another collective type under their name for a second, and
        operations every member is blocked on while none can complete."""
        self.dispatch(self.coordinator.expire_clashes(CLASH_GRACE))
        if self._deadlock_check:
            self.dispatch(self.coordinator.deadlocks())

    def abort_all(self, reason: str) -> None:
        """End the job's collectives everywhere with ``reason`` (the first reason wins)."""
        if not self._failed():
            log.error("gpucomm: %s", reason)
        self.dispatch([(tuple(range(self.size)), ("abort", reason))])

    def _send_stall_info(self, report: dict) -> None:
        self.dispatch([(tuple(range(1, self.size)), ("stall", report))])

    def close(self) -> None:
        for chan in self._workers.values():
            try:
                chan.sock.close()
            except OSError:
                pass


__all__ = ["CoordinatorHub"]
