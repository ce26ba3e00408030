"""This process's side of the control plane: submitted requests wait here until the coordinator
says they run, fail, or are done, and responses are executed in the order the coordinator sent them.

Progress is made by whichever thread needs it, under one lock: a thread waiting on a handle drives
the exchange itself (no thread hand-off on the latency path), and a background thread drives it
otherwise — it sends requests that were submitted without a wait after ``cycle_time``, executes
responses as soon as they arrive (so collectives start while the caller keeps computing), and, in
rank 0, serves the coordinator and runs the stall inspector. The background thread takes over only
``HANDBACK`` after the last caller's wait ended and sleeps on an event of its own meanwhile: in a
loop of synchronous collectives it would otherwise wake for every frame and notification and race
the caller for the CPU and the GIL (on a 2-core machine it cost about a fifth of each round).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import channel
from ..counters import COUNTERS
from ..dataplane.activity import backward_running
from ..dataplane.handles import Handle, Issued
from ..dataplane.inline import inline_result, payload_of
from ..dataplane.requests import Request
from ..errors import CollectiveError, ShutdownError
from .config import ControlConfig, ControlLinks, Send
from .cache import ResponseCache, with_bits
from .liveness import Liveness, start_beating
from .coordinator import Coordinator, set_bits
from .hub import CoordinatorHub
from .negotiation import Descriptor, descriptor_of
from .stalls import negotiation_timeout, stall_report
from .shutdown import Shutdown
from .standins import StandIns
from .upkeep import Upkeep

log = logging.getLogger("gpucomm.control")

Key = tuple[int, str]
Run = Callable[[Handle, dict], None]  # the data plane: issue an agreed request (now or in order) and settle it

HANDBACK = 0.002  # s the background thread leaves progress to callers after the last one's wait ended


@dataclass
class _Local:
    """What this rank has in flight under one key."""

    handle: Handle
    descriptor: Descriptor


class Controller(Upkeep, Shutdown):
    """Submits requests to the coordinator and hands its answers to the data plane (``run``); one
    per initialized job. ``standins`` takes part with zeros once this rank joined; ``on_fail``
    learns the job failed (the data plane then aborts its communicators); ``select_device`` makes
    this rank's GPU current on the control thread before anything else runs there (it returns False
    while the rank's GPU is not known, and is asked again before each round of work until it is). Its time-based
    checks (``upkeep.Upkeep``) and its shutdown (``shutdown.Shutdown``) live in base classes of their own."""

    def __init__(self, rank: int, size: int, run: Run, config: ControlConfig, *,
                 coordinator: Coordinator | None = None, links: ControlLinks = ControlLinks(),
                 on_done: Callable[[str, str, Any], None] | None = None,
                 standins: StandIns,
                 tracer: Callable[[], Any] = lambda: None,
                 on_fail: Callable[[CollectiveError], None] = lambda error: None,
                 select_device: Callable[[], bool | None] = lambda: None) -> None:
        self.rank, self.size, self.config = rank, size, config
        self.timeout = config.timeout
        self._run_agreed = run
        self._on_fail = on_fail
        self._select_device = select_device
        self._link = links.to_root  # other ranks: the channel to rank 0
        self._hub = None  # rank 0: the coordinator and the channels to the others
        if coordinator is not None:
            self._hub = CoordinatorHub(size, coordinator, links.workers, config, apply=self._apply,
                                       stopping=lambda: self._closed, failed=lambda: self._failure is not None,
                                       hosts=links.hosts)
        self._root_host = links.where(0)  # " on HOST": where rank 0 runs, for the errors that name it
        self._on_done = on_done or (lambda kind, name, value: None)
        self._tracer = tracer
        self._liveness = (Liveness([0], config.liveness_timeout)  # other ranks: is rank 0 still there?
                          if self._link is not None and config.liveness_timeout else None)
        self._blocked_since: dict[Key, float] = {}  # operations a caller waits on, since when
        self._blocked_told: set[Key] = set()  # ... of which rank 0 has been told
        self._in_step: str | None = None  # a DistributedOptimizer step this rank's caller blocks in (its transfers)
        self._in_step_told: str | None = None  # ... as rank 0 was last told
        # ranks that shut gpucomm down (rank 0 tells), in the order learnt: {(set id, schedule number): collectives
        # it launched} for each
        self.departed: dict[int, dict[tuple[int, int], int]] = {}
        self._lock = threading.Lock()  # held by the thread driving progress
        self._state = threading.RLock()  # guards the fields below (taken directly: a C-level context manager)
        self._cv = threading.Condition(self._state)  # notified when a handle becomes ready, if anyone waits
        self._cv_waiters = 0  # threads waiting on ``_cv`` (notifying nobody costs nothing)
        self._inflight: dict[Key, _Local] = {}
        self._unsent: list[tuple] = []
        self._unsent_since = 0.0
        self._cache = ResponseCache()
        self._failure: CollectiveError | None = None
        self.coordinator_lost = False  # rank 0 went away (its connection closed, or it fell silent)
        self._closed = False
        beats = self._liveness or (self._hub.liveness if self._hub is not None and links.workers else None)
        self._stop_beating = (start_beating(beats.interval, self._beat, f"gpucomm-heartbeat-{rank}")
                              if beats is not None else None)
        self._waiting = 0  # threads inside wait_ready
        self._wait_ended = 0.0
        self._bg_wake = threading.Event()  # set to end the background thread's hand-back pause at once
        self._next_housekeeping = 0.0
        self._standins = standins
        self._stall_info: dict[Key, list[int]] = {}
        self.frames_sent = 0  # request frames this rank sent (rank 0: coordinator steps that took requests)
        self.frames_received = 0
        self._waker = channel.Waker()
        self._thread = threading.Thread(target=self._background, name="gpucomm-control", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submitting

    def submit(self, request: Request, *, send: Send = Send.CYCLE) -> Handle:
        """Queue ``request`` for negotiation; ``send`` says when its request leaves (``Send``). A
        request the response cache knows travels as one bit of its frame."""
        descriptor = descriptor_of(request)
        payload = payload_of(request, self.config.inline_bytes, self.rank)
        key = (request.set_id, request.name)
        handle = Handle(request, self)
        with self._state:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise ShutdownError(f"{request.describe()} was submitted after gpucomm shut down; call hvd.init() first.")
            if key in self._inflight:
                raise ValueError(
                    f"another operation named '{request.name}' is still in flight on this rank; names must be unique "
                    f"among operations not yet synchronized. Synchronize the first one before reusing its name, or "
                    f"give each one its own name.")
            self._inflight[key] = _Local(handle, descriptor)
            if request.kind == "join":
                self._standins.joining = True
            item = self._cache.item(key, descriptor, payload)
            COUNTERS.negotiated += 1
            if item[0] == "hit":
                COUNTERS.cache_hits += 1
            was_empty = not self._unsent
            if was_empty:
                self._unsent_since = time.monotonic()
            self._unsent.append(item)
        if send is Send.NOW and self._lock.acquire(blocking=False):
            try:
                self._step(None, 0.0)
            finally:
                self._release()
        elif send is Send.NOW or (send is Send.CYCLE and was_empty):
            self._waker.wake()
        return handle

    # ------------------------------------------------------------------ waiting

    def wait_ready(self, handle: Handle, timeout: float) -> None:
        """Drive progress until ``handle`` has been issued or failed; raise after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        key = (handle.request.set_id, handle.request.name)
        with self._state:
            self._waiting += 1  # the background thread stays out of the way meanwhile
            self._blocked_since.setdefault(key, time.monotonic())
        try:
            while not handle.agreed():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveError(self._timeout_message(handle, timeout))
                if self._lock.acquire(blocking=False):
                    try:
                        self._step(handle, deadline)
                    finally:
                        self._release()
                else:  # another thread drives: wait until it has released the lock or settled this handle
                    with self._state:
                        self._cv_waiters += 1
                        try:
                            self._cv.wait_for(lambda: handle.agreed() or not self._lock.locked(), min(remaining, 0.05))
                        finally:
                            self._cv_waiters -= 1
        finally:
            with self._state:
                self._waiting -= 1
                self._blocked_since.pop(key, None)
                self._blocked_told.discard(key)
                if not self._waiting:
                    self._wait_ended = time.monotonic()

    def note_in_step(self, what: str | None) -> None:
        """(any thread) A fixed schedule's step blocks in its transfers (``what``), or no longer (None):
        rank 0 hears of it at the next upkeep, as of a caller blocked on a negotiation."""
        with self._state:
            self._in_step = what

    def _release(self) -> None:
        self._lock.release()
        self._notify()

    def _notify(self) -> None:
        """Wake the threads waiting for a handle or for the progress lock (if there are any)."""
        if self._cv_waiters:
            with self._state:
                self._cv.notify_all()

    def failure(self) -> CollectiveError | None:
        """Why this job's control plane stopped (a rank failed, a stall shutdown), if it did."""
        return self._failure

    def _timeout_message(self, handle: Handle, timeout: float) -> str:
        key = (handle.request.set_id, handle.request.name)
        if self._hub is not None:
            with self._lock:
                missing = next((m for s, n, _, m in self._hub.coordinator.stalled(0.0) if (s, n) == key), None)
        else:
            missing = self._stall_info.get(key)
        return negotiation_timeout(handle.request.describe(), missing, timeout)

    # ------------------------------------------------------------------ progress (caller holds self._lock)

    def _step(self, until: Handle | None, deadline: float) -> None:
        """Send what is queued, execute what has arrived; with ``until``, keep going until it is ready
        (polling for at most ``config.spin`` of the whole wait, then sleeping in ``select``; not at
        all while a gradient-hook backward runs, whose hook threads need the GIL a poll takes)."""
        spin_until = time.perf_counter() + self._spin_budget()
        while True:
            self._flush()
            if until is not None and until.agreed():
                return
            wait = 0.0 if until is None else min(deadline - time.monotonic(), self._stall_tick())
            spin = max(0.0, spin_until - time.perf_counter())
            ready = channel.readable(self._sockets() + [self._waker.fd], max(0.0, wait),
                                     spin=spin)  # no wait (until None): no poll
            if spin > 0.0 and backward_running():
                spin_until = 0.0  # a backward began during this wait (the poll stopped): sleep from now on
            for sock in ready:
                if sock == self._waker.fd:
                    self._waker.drain()
                else:
                    self._receive_from(sock)
            self._housekeeping()
            if until is None or until.agreed() or time.monotonic() >= deadline:
                return

    def _spin_budget(self) -> float:
        """Seconds a wait starting now may poll: ``config.spin``, or 0 while a gradient-hook
        backward runs (counted in ``spin_skipped_backward``)."""
        if self.config.spin > 0.0 and backward_running():
            COUNTERS.spin_skipped_backward += 1
            return 0.0
        return self.config.spin

    def _sockets(self) -> list:
        if self._link is not None:
            return [self._link.sock]
        return self._hub.sockets() if self._hub is not None else []

    def _flush(self) -> None:
        with self._state:
            items, self._unsent = self._unsent, []
        if not items:
            return
        self.frames_sent += 1
        COUNTERS.control_rounds += 1
        items = with_bits(items)
        tracer = self._tracer()
        if tracer is not None:
            tracer.cycle()
        if self._hub is not None:
            self._hub.submit_own(items)
        else:
            try:
                channel.send(self._link, items)
            except OSError as e:
                self._fail(f"the control connection to rank 0 broke while sending requests ({e}); rank 0"
                           f"{self._root_host} has probably exited or failed, or its host is unreachable.")

    def _receive(self, timeout: float) -> None:
        socks = self._sockets()
        if socks:
            for sock in channel.readable(socks, timeout):
                self._receive_from(sock)

    def _receive_from(self, sock) -> None:
        if self._hub is not None:
            self._hub.receive(sock)
        elif self._link is not None and sock is self._link.sock:
            self._receive_from_coordinator()

    def _receive_from_coordinator(self) -> None:
        try:
            responses = channel.recv(self._link)
        except (OSError, channel.FrameError, EOFError) as e:
            if not self._closed:
                self.coordinator_lost = True
                self._fail(f"the control connection to rank 0 (the coordinator) closed ({e or 'end of stream'}): "
                           f"rank 0{self._root_host} exited or failed, or its host is unreachable. Its own output "
                           f"says why.")
            self._link.sock.close()
            self._link = None
            return
        self.frames_received += 1
        if self._liveness is not None:
            self._liveness.heard(0)
        for response in responses:
            self._apply(response)

    # ------------------------------------------------------------------ applying responses

    def _apply(self, response: tuple) -> None:
        tag = response[0]
        if tag == "abort":
            self._fail(response[1])
            return
        if tag == "stall":
            self._stall_info = response[1]
            return
        if tag == "hb":
            return
        if tag == "left":  # a rank shut gpucomm down: a fixed schedule's step it never ran fails naming it
            self.departed.setdefault(response[1], {(s, n): k for s, n, k in response[2]})
            return
        if tag == "bits":  # cached operations whose answer is unchanged: run them in cache-id order
            for cache_id in set_bits(response[1]):
                key = self._cache.key_of(cache_id)
                with self._state:
                    local = self._inflight.pop(key, None)
                self._run(key, local, cache_id, None, None)
            return
        set_id, name = response[1], response[2]
        key = (set_id, name)
        with self._state:
            local = self._inflight.pop(key, None)
        if tag == "run":
            self._run(key, local, response[3], response[4], response[5])
        elif tag == "error":
            self._cache.forget(key)
            if local is not None:
                self._settle(local.handle, error=CollectiveError(response[3]))
        elif tag == "done":
            if local is not None:
                self._on_done(local.descriptor.kind, name, response[3])
                if local.descriptor.kind == "join":
                    self._standins.finish(self.timeout)
                self._settle(local.handle, issued=Issued(finalize=lambda v=response[3]: v))
            else:
                self._on_done("", name, response[3])

    def _run(self, key: Key, local: _Local | None, cache_id: int, meta: dict | None, result: bytes | None) -> None:
        meta = self._cache.answer(key, cache_id, meta)
        if local is None:
            if result is None:  # reduced by the coordinator: nothing for a joined rank to do
                self._stand_in(key, meta)
            return
        if cache_id >= 0:
            self._cache.remember(key, cache_id, local.descriptor)
        if result is not None:
            request = local.handle.request
            if request.kind == "allreduce":
                COUNTERS.inline_reductions += 1
            else:
                COUNTERS.inline_moves += 1
            tracer = self._tracer()
            if tracer is not None:
                tracer.inline_op(request.name, request.kind, request.tensors)
            self._settle(local.handle, issued=Issued(finalize=lambda: inline_result(request, result, meta)))
            return
        try:
            self._run_agreed(local.handle, meta)  # issued now, or queued in its device's order
        except BaseException as e:  # noqa: BLE001 - the error belongs to whoever waits on the handle
            local.handle.settle(error=e)
        self._notify()

    def _stand_in(self, key: Key, meta: dict) -> None:
        """This rank joined: take part in ``key``'s collective with zeros, as the others expect."""
        if not self._standins.joining or meta.get("template") is None:
            self._fail(f"internal error: rank {self.rank} was told to run '{key[1]}', which it never submitted and "
                       f"it has not joined. Please report this as a gpucomm bug.")
            return
        try:
            self._standins.run(key[0], key[1], meta)
        except BaseException as e:  # noqa: BLE001
            self._fail(f"rank {self.rank} (joined) could not take part in '{key[1]}' with zeros: {e}")

    def _settle(self, handle: Handle, *, issued: Issued | None = None, error: BaseException | None = None) -> None:
        with self._state:
            handle.settle(issued=issued, error=error)
        self._notify()

    def _fail(self, reason: str) -> None:
        """Stop this rank's collectives: every pending and later operation raises ``reason``, and
        the data plane aborts its communicators (``on_fail``)."""
        if self._stop_beating is not None:
            self._stop_beating.set()
        with self._state:
            if self._failure is not None:
                return
            self._failure = failure = CollectiveError(reason)
            self._fail_pending(lambda local: failure)
        self._on_fail(failure)

    def _fail_pending(self, error: Callable[[_Local], BaseException]) -> None:
        """(holding ``_cv``) Settle every request not yet agreed with ``error(local)``."""
        pending, self._inflight, self._unsent = list(self._inflight.values()), {}, []
        for local in pending:
            if not local.handle.agreed():
                local.handle.settle(error=error(local))
        self._cv.notify_all()

    # ------------------------------------------------------------------ background thread

    def _select_gpu(self) -> bool:
        """(the control thread) Select this rank's GPU before any CUDA work here (answers it issues,
        stand-ins); False while it is not known yet (a rank with none pinned adopts it from the first CUDA
        tensor handed in: this thread would be on GPU 0 otherwise)."""
        try:
            return self._select_device() is not False
        except Exception as e:  # noqa: BLE001 - without its GPU this thread must not touch CUDA at all
            log.exception("gpucomm control thread could not select this rank's GPU")
            self._fail(f"the gpucomm control thread of rank {self.rank} could not select this rank's GPU: {e}")
            return True

    def _background(self) -> None:
        selected = self._select_gpu()
        while not self._closed:
            if self._waiting or time.monotonic() - self._wait_ended < HANDBACK:
                # a caller drives progress; it may wait again at once (a loop of synchronous ops), so
                # stay out of its way a little longer rather than race it for every frame
                self._bg_wake.wait(HANDBACK)
                continue
            with self._state:
                unsent, since = bool(self._unsent), self._unsent_since
            wait = self._stall_tick()
            if unsent:
                wait = min(wait, max(0.0, since + self.config.cycle_time - time.monotonic()))
            ready = channel.readable(self._sockets() + [self._waker.fd], wait)
            if self._closed:
                return
            if self._waiting:
                continue
            if self._waker.fd in ready:
                self._waker.drain()
            with self._state:
                due = bool(self._unsent) and time.monotonic() >= self._unsent_since + self.config.cycle_time
            if not (due or len(ready) > (self._waker.fd in ready) or self._hub is not None
                    or self._liveness is not None or self._in_step != self._in_step_told):
                continue
            if not self._lock.acquire(timeout=self._stall_tick()):
                continue
            try:
                if self._closed:
                    return
                try:
                    if not selected:
                        selected = self._select_gpu()
                    if due:
                        self._flush()
                    self._receive(0.0)
                    self._housekeeping()
                except Exception:  # never let the thread die silently: the job would hang instead
                    log.exception("gpucomm control thread failed")
                    self._fail("the gpucomm control thread failed (see the log above); this is a gpucomm bug.")
            finally:
                self._release()

__all__ = ["ControlConfig", "ControlLinks", "Controller", "Send", "stall_report"]
