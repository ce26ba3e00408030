"""This process's side of the control plane: submitted requests wait here until the coordinator
says they run, fail, or are done, and responses are executed in the order the coordinator sent them.

Progress is made by whichever thread needs it, under one lock: a thread waiting on a handle drives
the exchange itself (no thread hand-off on the latency path), and a background thread drives it
otherwise — it sends requests that were submitted without a wait after ``cycle_time``, executes
responses as soon as they arrive (so collectives start while the caller keeps computing), and, in
rank 0, serves the coordinator and runs the stall inspector.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import channel as wire
from ..counters import COUNTERS
from ..dataplane.executor import prepare
from ..dataplane.handles import Handle, Issued
from ..dataplane.inline import inline_payload, write_inline
from ..dataplane.requests import Request
from ..dataplane.watchdog import NcclWatchdog
from ..errors import CollectiveError, ShutdownError
from .config import ControlConfig, ControlLinks, Send
from .coordinator import Coordinator, Outgoing, set_bits
from .negotiation import Descriptor, descriptor_of
from .stalls import StallInspector, stall_report

log = logging.getLogger("gpucomm.control")

Key = tuple[int, str]
Execute = Callable[[Request, dict], Issued]


@dataclass
class _Local:
    """What this rank has in flight under one key."""

    handle: Handle
    descriptor: Descriptor


class Controller:
    """Submits requests to the coordinator and executes its responses; one per initialized job."""

    def __init__(self, rank: int, size: int, execute: Execute, config: ControlConfig, *,
                 coordinator: Coordinator | None = None, links: ControlLinks = ControlLinks(),
                 on_done: Callable[[str, str, Any], None] | None = None,
                 zeros_device: Callable[[], torch.device] | None = None,
                 tracer: Callable[[], Any] = lambda: None,
                 nccl_health: Callable[[int, bool], str | None] = lambda set_id, abort: None) -> None:
        self.rank, self.size, self.config = rank, size, config
        self.timeout = config.timeout
        self._execute = execute
        self._coordinator = coordinator
        self._workers = dict(links.workers)  # rank 0: rank -> channel
        self._rank_of = {c.sock: r for r, c in self._workers.items()}
        self._link = links.to_root  # other ranks: the channel to rank 0
        self._on_done = on_done or (lambda kind, name, value: None)
        self._zeros_device = zeros_device or (lambda: torch.device("cpu"))
        self._tracer = tracer
        self._watchdog = NcclWatchdog(rank, config.timeout, nccl_health,
                                      lambda why: self.report_failure(why, locked=True))
        self._stalls = None
        if coordinator is not None and config.stall_warning is not None:
            self._stalls = StallInspector(coordinator, config.stall_warning, config.stall_shutdown,
                                          report=self._send_stall_info, abort=self._abort_all)
        self._lock = threading.Lock()  # held by the thread driving progress
        self._cv = threading.Condition()  # guards the fields below; notified when a handle becomes ready
        self._inflight: dict[Key, _Local] = {}
        self._unsent: list[tuple] = []
        self._unsent_since = 0.0
        self._cache: dict[Key, tuple[int, Descriptor]] = {}  # the response cache: key -> (id, descriptor)
        self._cache_keys: dict[int, Key] = {}  # id -> key
        self._meta: dict[int, dict] = {}
        self._failure: CollectiveError | None = None
        self._closed = False
        self._joining = False
        self._waiting = 0  # threads inside wait_ready
        self._standins: list[Issued] = []
        self._stall_info: dict[Key, list[int]] = {}
        self._failed_reports: dict[int, str] = {}  # rank 0: ranks that reported a failure before leaving
        self._left: set[int] = set()  # rank 0: ranks whose connections ended
        self.frames_sent = 0  # request frames this rank sent (rank 0: coordinator steps that took requests)
        self.frames_received = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._background, name="gpucomm-control", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submitting

    def submit(self, request: Request, *, send: Send = Send.CYCLE) -> Handle:
        """Queue ``request`` for negotiation; ``send`` says when its request leaves (``Send``). A
        request the response cache knows travels as one bit of its frame."""
        descriptor = descriptor_of(request)
        payload = inline_payload(request, self.config.inline_bytes)
        key = (request.set_id, request.name)
        handle = Handle(request, self)
        with self._cv:
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
                self._joining = True
            cached = self._cache.get(key)
            if cached is not None and cached[1] == descriptor:
                item: tuple = ("hit", cached[0], payload)
                COUNTERS.cache_hits += 1
            else:
                item = ("req", key[0], key[1], descriptor, payload)
            COUNTERS.negotiated += 1
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
            self._wake()
        return handle

    def watch(self, done_event: Any, request: Request) -> None:
        """Hand a CUDA collective issued elsewhere (a fixed schedule) to the NCCL watchdog."""
        self._watchdog.watch(done_event, request)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed, or the pipe is full: the thread is awake anyway
            pass

    # ------------------------------------------------------------------ waiting

    def wait_ready(self, handle: Handle, timeout: float) -> None:
        """Drive progress until ``handle`` has been issued or failed; raise after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._waiting += 1  # the background thread stays out of the way meanwhile
        try:
            while not handle._ready():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveError(self._timeout_message(handle, timeout))
                if self._lock.acquire(blocking=False):
                    try:
                        self._step(handle, deadline)
                    finally:
                        self._release()
                else:
                    with self._cv:
                        self._cv.wait_for(lambda: handle._ready() or not self._lock.locked(), min(remaining, 0.05))
        finally:
            with self._cv:
                self._waiting -= 1
                if not self._waiting:
                    self._cv.notify_all()

    def _release(self) -> None:
        self._lock.release()
        with self._cv:
            self._cv.notify_all()

    def failure(self) -> CollectiveError | None:
        """Why this job's control plane stopped (a rank failed, a stall shutdown), if it did."""
        return self._failure

    def _timeout_message(self, handle: Handle, timeout: float) -> str:
        key = (handle.request.set_id, handle.request.name)
        missing = None
        if self._coordinator is not None:
            with self._lock:
                missing = next((m for s, n, _, m in self._coordinator.stalled(0.0) if (s, n) == key), None)
        else:
            missing = self._stall_info.get(key)
        who = (f"ranks {missing} have not submitted it" if missing else
               "the coordinator (rank 0) has not answered")
        return (f"{handle.request.describe()} was not negotiated within {timeout:.0f} s: {who}. Every rank must "
                f"run the same collectives (same names) in the same order; a rank that ran out of data should call "
                f"hvd.join(). GPUCOMM_TIMEOUT sets this limit.")

    # ------------------------------------------------------------------ progress (caller holds self._lock)

    def _step(self, until: Handle | None, deadline: float) -> None:
        """Send what is queued, execute what has arrived; with ``until``, keep going until it is ready."""
        while True:
            self._flush()
            if until is not None and until._ready():
                return
            wait = 0.0 if until is None else min(deadline - time.monotonic(), self._stall_tick())
            ready = wire.readable(self._sockets() + [self._wake_r], max(0.0, wait))
            for sock in ready:
                if sock == self._wake_r:
                    self._drain_wake()
                else:
                    self._receive_from(sock)
            self._housekeeping()
            if until is None or until._ready() or time.monotonic() >= deadline:
                return

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _sockets(self) -> list:
        if self._link is not None:
            return [self._link.sock]
        return [c.sock for r, c in self._workers.items() if r not in self._left]

    def _flush(self) -> None:
        with self._cv:
            items, self._unsent = self._unsent, []
        if not items:
            return
        self.frames_sent += 1
        COUNTERS.control_rounds += 1
        items = _with_bits(items)
        tracer = self._tracer()
        if tracer is not None:
            tracer.cycle()
        if self._coordinator is not None:
            self._dispatch(self._coordinator.submit(0, items))
        else:
            try:
                wire.send(self._link, items)
            except OSError as e:
                self._fail(f"the control connection to rank 0 broke while sending requests ({e}); rank 0 has "
                           f"probably exited or failed.")

    def _receive(self, timeout: float) -> None:
        socks = self._sockets()
        if socks:
            for sock in wire.readable(socks, timeout):
                self._receive_from(sock)

    def _receive_from(self, sock) -> None:
        if self._link is not None:
            if sock is self._link.sock:
                self._receive_from_coordinator()
            return
        rank = self._rank_of.get(sock)
        if rank is not None and rank not in self._left:
            self._receive_from_worker(rank)

    def _receive_from_coordinator(self) -> None:
        try:
            responses = wire.recv(self._link)
        except (OSError, wire.FrameError, EOFError) as e:
            if not self._closed:
                self._fail(f"the control connection to rank 0 (the coordinator) closed ({e or 'end of stream'}): "
                           f"rank 0 exited or failed. Its own output says why.")
            self._link.sock.close()
            self._link = None
            return
        self.frames_received += 1
        for response in responses:
            self._apply(response)

    def _receive_from_worker(self, rank: int) -> None:
        try:
            items = wire.recv(self._workers[rank])
        except (OSError, wire.FrameError, EOFError) as e:
            self._lost(rank, f"its control connection closed ({e or 'end of stream'})")
            return
        self.frames_received += 1
        requests = []
        for item in items:
            if item[0] == "bye":
                self._left.add(rank)
                self._dispatch(self._coordinator.rank_left(rank, f"rank {rank} has shut gpucomm down"))
            elif item[0] == "fail":
                self._failed_reports.setdefault(rank, item[1])
                self._abort_all(f"rank {rank} failed: {item[1]}")
            else:
                requests.append(item)
        if requests:
            try:
                self._dispatch(self._coordinator.submit(rank, requests))
            except Exception as e:  # a protocol violation: the job cannot go on consistently
                self._abort_all(f"rank {rank} sent a request the coordinator cannot accept: {e}")

    def _lost(self, rank: int, what: str) -> None:
        if rank in self._left:
            return
        self._left.add(rank)
        self._workers[rank].sock.close()
        if self._closed:
            return
        cause = self._failed_reports.get(rank)
        reason = (f"rank {rank} failed: {cause}" if cause else
                  f"rank {rank} exited or crashed without shutting gpucomm down ({what})")
        self._abort_all(reason)

    def _dispatch(self, outgoing: list[Outgoing]) -> None:
        """Rank 0: send each response to its ranks (one frame per rank) and apply this rank's own."""
        frames: dict[int, list] = {}
        mine = []
        for ranks, response in outgoing:
            for r in ranks:
                if r == self.rank:
                    mine.append(response)
                elif r not in self._left:
                    frames.setdefault(r, []).append(response)
        for r, responses in frames.items():
            try:
                wire.send(self._workers[r], responses)
            except OSError as e:
                self._lost(r, f"sending to it failed: {e}")
        for response in mine:
            self._apply(response)

    def _abort_all(self, reason: str) -> None:
        """Rank 0: end the job's collectives everywhere with ``reason`` (the first reason wins)."""
        if self._failure is None:
            log.error("gpucomm: %s", reason)
        self._dispatch([(tuple(range(self.size)), ("abort", reason))])

    # ------------------------------------------------------------------ applying responses

    def _apply(self, response: tuple) -> None:
        tag = response[0]
        if tag == "abort":
            self._fail(response[1])
            return
        if tag == "stall":
            self._stall_info = response[1]
            return
        if tag == "bits":  # cached operations whose answer is unchanged: run them in cache-id order
            for cache_id in set_bits(response[1]):
                key = self._cache_keys[cache_id]
                with self._cv:
                    local = self._inflight.pop(key, None)
                self._run(key, local, cache_id, None, None)
            return
        set_id, name = response[1], response[2]
        key = (set_id, name)
        with self._cv:
            local = self._inflight.pop(key, None)
        if tag == "run":
            if response[5] is not None:
                COUNTERS.inline_reductions += 1
            self._run(key, local, response[3], response[4], response[5])
        elif tag == "error":
            cached = self._cache.pop(key, None)
            if cached is not None:
                self._cache_keys.pop(cached[0], None)
            if local is not None:
                self._settle(local.handle, error=CollectiveError(response[3]))
        elif tag == "done":
            if local is not None:
                self._on_done(local.descriptor.kind, name, response[3])
                if local.descriptor.kind == "join":
                    self._finish_join()
                self._settle(local.handle, issued=Issued(finalize=lambda v=response[3]: v))
            else:
                self._on_done("", name, response[3])

    def _run(self, key: Key, local: _Local | None, cache_id: int, meta: dict | None, result: bytes | None) -> None:
        if meta is None:
            meta = self._meta.get(cache_id, {})
        elif cache_id >= 0:
            self._meta[cache_id] = meta
            self._cache_keys[cache_id] = key
        if local is None:
            if result is None:  # reduced by the coordinator: nothing for a joined rank to do
                self._stand_in(key, meta)
            return
        if cache_id >= 0:
            self._cache[key] = (cache_id, local.descriptor)
        if result is not None:
            request = local.handle.request
            tracer = self._tracer()
            if tracer is not None:
                tracer.inline_op(request.name, request.kind, request.tensors)
            self._settle(local.handle, issued=Issued(finalize=lambda: write_inline(request, result)))
            return
        try:
            issued = self._execute(local.handle.request, meta)
        except BaseException as e:  # noqa: BLE001 - the error belongs to whoever waits on the handle
            self._settle(local.handle, error=e)
            return
        if issued.done_event is not None:  # watched: a CUDA collective never blocks the host
            self._watchdog.watch(issued.done_event, local.handle.request)
        self._settle(local.handle, issued=issued)

    def _stand_in(self, key: Key, meta: dict) -> None:
        """This rank joined: take part in ``key``'s collective with zeros, as the others expect."""
        template: Descriptor | None = meta.get("template")
        if not self._joining or template is None:
            self._fail(f"internal error: rank {self.rank} was told to run '{key[1]}', which it never submitted and "
                       f"it has not joined. Please report this as a gpucomm bug.")
            return
        device = torch.device("cpu") if template.device == "cpu" else self._zeros_device()
        tensors = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                   for dtype, shape in zip(template.dtypes, template.shapes)]
        request = Request(template.kind, key[1], tensors, outputs=tensors, op=template.op, prescale=template.prescale,
                          postscale=template.postscale, root=template.root, splits=template.splits, device=device,
                          set_id=key[0])
        if device.type == "cuda":
            request.stream = torch.cuda.current_stream(device)
            request.ready_event = torch.cuda.Event()
            request.ready_event.record(request.stream)
        if request.kind in ("allreduce", "broadcast"):
            prepare(request)
        try:
            self._standins.append(self._execute(request, meta))
        except BaseException as e:  # noqa: BLE001
            self._fail(f"rank {self.rank} (joined) could not take part in '{key[1]}' with zeros: {e}")

    def _finish_join(self) -> None:
        standins, self._standins = self._standins, []
        self._joining = False
        for issued in standins:
            for w in issued.works:
                w.wait(self.timeout)

    def _settle(self, handle: Handle, *, issued: Issued | None = None, error: BaseException | None = None) -> None:
        with self._cv:
            if error is not None:
                handle._error = error
            else:
                handle._issued = issued
            self._cv.notify_all()

    def _fail(self, reason: str) -> None:
        """Stop this rank's collectives: every pending and later operation raises ``reason``."""
        with self._cv:
            if self._failure is not None:
                return
            self._failure = CollectiveError(reason)
            pending, self._inflight, self._unsent = list(self._inflight.values()), {}, []
            for local in pending:
                if not local.handle._ready():
                    local.handle._error = self._failure
            self._cv.notify_all()

    # ------------------------------------------------------------------ housekeeping

    def _stall_tick(self) -> float:
        return 0.25 if self._stalls is not None else 1.0

    def _housekeeping(self) -> None:
        if self._standins:
            self._standins = [s for s in self._standins if not all(w.done() for w in s.works)]
        if self._watchdog:
            self._watchdog.check()
        if self._stalls is not None:
            self._stalls.check()

    def _send_stall_info(self, report: dict) -> None:
        self._dispatch([(tuple(r for r in range(self.size) if r != 0), ("stall", report))])

    # ------------------------------------------------------------------ background thread

    def _background(self) -> None:
        while not self._closed:
            if self._waiting:  # a waiting caller drives: stay out of its way until it is done
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or not self._waiting, self._stall_tick())
                continue
            with self._cv:
                unsent, since = bool(self._unsent), self._unsent_since
            wait = self._stall_tick()
            if unsent:
                wait = min(wait, max(0.0, since + self.config.cycle_time - time.monotonic()))
            ready = wire.readable(self._sockets() + [self._wake_r], wait)
            if self._closed:
                return
            if self._waiting:
                continue
            if self._wake_r in ready:
                self._drain_wake()
            with self._cv:
                due = bool(self._unsent) and time.monotonic() >= self._unsent_since + self.config.cycle_time
            if not (due or len(ready) > (self._wake_r in ready) or self._coordinator is not None
                    or self._watchdog):
                continue
            if not self._lock.acquire(timeout=self._stall_tick()):
                continue
            try:
                if self._closed:
                    return
                try:
                    if due:
                        self._flush()
                    self._receive(0.0)
                    self._housekeeping()
                except Exception:  # never let the thread die silently: the job would hang instead
                    log.exception("gpucomm control thread failed")
                    self._fail("the gpucomm control thread failed (see the log above); this is a gpucomm bug.")
            finally:
                self._release()

    # ------------------------------------------------------------------ shutdown

    def report_failure(self, text: str, *, locked: bool = False) -> None:
        """This rank is failing with ``text``: tell the coordinator first, so every rank names it
        (``locked``: the caller already holds the progress lock)."""
        if not locked:
            with self._lock:
                return self.report_failure(text, locked=True)
        if self._coordinator is not None:
            self._abort_all(f"rank {self.rank} failed: {text}")
        else:
            if self._link is not None:
                try:
                    wire.send(self._link, [("fail", text)])
                except OSError:
                    pass
            self._fail(f"rank {self.rank} failed: {text}")

    def stop(self) -> None:
        """Stop taking requests; pending ones fail with ``ShutdownError``. Rank 0 keeps serving the
        coordinator until ``close``."""
        with self._cv:
            if self._closed:
                return
            pending, self._inflight, self._unsent = list(self._inflight.values()), {}, []
            for local in pending:
                if not local.handle._ready():
                    local.handle._error = ShutdownError(
                        f"{local.handle.request.describe()} never ran: gpucomm was shut down while it was pending.")
            self._cv.notify_all()
        if self._link is not None:
            with self._lock:
                self._closed = True
                try:
                    wire.send(self._link, [("bye",)])
                except OSError:
                    pass

    def wait_workers_gone(self, grace: float) -> bool:
        """Rank 0: serve the other ranks until each has shut down (or ``grace`` s passed)."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._left) >= len(self._workers):
                    return True
                self._receive(min(0.05, max(0.0, deadline - time.monotonic())))
        return len(self._left) >= len(self._workers)

    def close(self) -> None:
        """Stop the thread and close every connection."""
        self.stop()
        self._closed = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            for chan in list(self._workers.values()) + ([self._link] if self._link is not None else []):
                try:
                    chan.sock.close()
                except OSError:
                    pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _with_bits(items: list[tuple]) -> list[tuple]:
    """A frame's items with every payload-free cache hit folded into one ``("bits", ids)`` item."""
    bits, out = 0, []
    for item in items:
        if item[0] == "hit" and item[2] is None:
            bits |= 1 << item[1]
        else:
            out.append(item)
    if bits:
        out.append(("bits", bits))
    return out


__all__ = ["ControlConfig", "ControlLinks", "Controller", "Send", "stall_report"]
