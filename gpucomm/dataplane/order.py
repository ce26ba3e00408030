"""One order per device. Every NCCL call a rank makes on a device (all communicators) is issued
in an order that is the same on every rank; nothing on the fixed schedule is negotiated, and
nothing negotiated is issued from a thread that races the schedule. (DESIGN.md's rule; this
module enforces it.)

NCCL's rule: collectives on several communicators of one GPU must be issued in the same order on
every rank, or a kernel waiting for a peer can hold the GPU that the peer's kernel needs, and the
job deadlocks. A rank issues two kinds of CUDA collectives: its DistributedOptimizers' *fixed
schedules* (bucket allreduces launched from backward hooks in bucket order, the same on every rank
by construction; nothing on a schedule is negotiated) and *negotiated* collectives (``hvd.allreduce``
and friends, SyncBatchNorm, ``hvd.join``'s zeros), whose order is the coordinator's answer order,
also the same on every rank. What must agree is how the two interleave. The rule:

* A schedule's step is an *epoch*: it opens before the step's first launch and closes after its
  last. Opening waits until every negotiated collective this rank submitted earlier is agreed,
  and issues them first.
* Agreed negotiated work is issued at once (in answer order) when no epoch is open on its device,
  by whichever thread received the answer; while one is open it waits in this queue, and the
  epoch's close issues it.
* A thread that waits for a queued collective inside backward (SyncBatchNorm) issues the queue up
  to it in place: backward runs the same nodes in the same order on every rank. Waiting (or
  polling) outside backward first finishes the open epochs (``flush``: the rest of the step is
  launched, as ``synchronize()`` would), then issues. A poll inside backward issues nothing.

So a negotiated collective submitted before a step is issued before that step's buckets on every
rank, and one submitted during a step after them; its place never depends on when its answer
happened to arrive. Entries of one queue run one at a time under the queue's lock.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable

from ..counters import COUNTERS
from ..errors import CollectiveError


def in_backward() -> bool:
    """True on a thread that is running an autograd backward pass (a hook or a Function's backward)."""
    try:
        import torch  # noqa: PLC0415

        return torch._C._current_graph_task_id() != -1
    except (ImportError, AttributeError):  # a torch without the query: assume not (waits then flush)
        return False


class IssueOrder:
    """The issue order of one device (see the module doc). ``failure()`` names the job's failure;
    ``timeout`` bounds an epoch's wait for agreement."""

    def __init__(self, name: str, *, timeout: float, failure: Callable[[], CollectiveError | None]) -> None:
        self.name = name
        self.timeout = timeout
        self._failure = failure
        self._lock = threading.RLock()
        self._queue: collections.deque = collections.deque()  # (handle or None, issue) in answer order
        self._submitted: list[Any] = []  # this rank's negotiated handles not yet agreed
        self._epochs: dict[int, Callable[[], None]] = {}  # open epochs: token -> flush
        self._tokens = itertools.count(1)
        self._failed: BaseException | None = None  # once set, nothing more is issued
        self.deferred = 0  # agreed entries that had to wait for an epoch to close (or for a waiter)

    # -- negotiated work ------------------------------------------------------------------------
    def submitted(self, handle: Any) -> None:
        """This rank submitted ``handle`` for negotiation: the next epoch waits until it is agreed.
        (Handles leave this list when agreed; those that failed before are pruned here, so a job
        that never steps an optimizer keeps nothing alive.)"""
        with self._lock:
            if len(self._submitted) >= 64:
                self._submitted = [h for h in self._submitted if not h.agreed()]
            self._submitted.append(handle)

    def agreed(self, handle: Any, issue: Callable[[], None]) -> None:
        """``handle`` (None for a stand-in) is agreed; ``issue()`` issues it and settles the handle.
        Issued now unless an epoch is open (then by the epoch's close, or by a waiter)."""
        with self._lock:
            if self._failed is not None:
                if handle is not None:
                    handle.settle(error=self._failed)
                return
            if handle is not None:
                handle.queue(self)
                try:
                    self._submitted.remove(handle)
                except ValueError:
                    pass  # not this rank's own submission (or already pruned)
            self._queue.append((handle, issue))
            if self._epochs:
                self.deferred += 1
                COUNTERS.issue_deferred += 1
            else:
                self._issue_until(None)

    def issue_for_wait(self, handle: Any) -> None:
        """A caller waits for ``handle``: issue the queue up to it (see the module doc)."""
        with self._lock:
            if not self._contains(handle):
                return
            if not self._epochs or in_backward():
                self._issue_until(handle)
                return
            flushes = list(self._epochs.values())
        for flush in flushes:  # outside the lock: a flush launches on schedules (their locks first)
            flush()
        with self._lock:
            self._issue_until(handle)

    def issue_for_poll(self, handle: Any) -> None:
        """A caller polls ``handle``: as ``issue_for_wait``, except that inside backward nothing is issued."""
        if in_backward():
            with self._lock:
                if not self._epochs:
                    self._issue_until(handle)
            return
        self.issue_for_wait(handle)

    def stop(self, error: BaseException) -> None:
        """Nothing more is issued (the job failed): without the lock, which a thread issuing a collective
        holds while NCCL's host call may block until the communicators are aborted (``DataPlane.fail``
        stops every order, then aborts, then ``fail``s them)."""
        if self._failed is None:
            self._failed = error

    def fail(self, error: BaseException) -> None:
        """The job failed (or shut down): every queued handle fails with ``error``; nothing more is issued.
        The handles are settled under the lock (no CUDA work): a waiter that takes it next finds its
        handle failed, never taken out of the queue yet unsettled."""
        with self._lock:
            if self._failed is None:
                self._failed = error
            queued, self._queue = list(self._queue), collections.deque()
            self._submitted.clear()
            for handle, _ in queued:
                if handle is not None:
                    handle.settle(error=error)

    # -- epochs (fixed schedules) -----------------------------------------------------------------
    def open_epoch(self, flush: Callable[[], None]) -> int:
        """A schedule step starts: wait until this rank's earlier submissions are agreed, issue the
        queue, open the epoch. ``flush()`` finishes the step's launches (and closes the epoch) when a
        caller outside backward needs the queue. Returns the token for ``close_epoch``."""
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                self._submitted = [h for h in self._submitted if not h.agreed()]
                if not self._submitted:
                    self._issue_until(None)
                    token = next(self._tokens)
                    self._epochs[token] = flush
                    return token
                waiting = self._submitted[0]
            failure = self._failure()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"a DistributedOptimizer step on {self.name} waited {self.timeout:.0f} s (GPUCOMM_TIMEOUT) for the "
                    f"ranks to agree on {waiting.request.describe()}, which this rank submitted before the step. "
                    f"Collectives submitted before an optimizer step must be submitted before that step on every "
                    f"rank (their NCCL calls are ordered before the step's). Likely cause: some ranks submit it "
                    f"only after backward, or never. Fix: submit it at the same point of the training loop on "
                    f"every rank.")
            time.sleep(0.0005)

    def close_epoch(self, token: int) -> None:
        """The step's last launch was issued: close its epoch and issue what waited for it."""
        with self._lock:
            self._epochs.pop(token, None)
            if not self._epochs:
                self._issue_until(None)

    @property
    def epoch_open(self) -> bool:
        return bool(self._epochs)

    # -- internals (holding the lock) -----------------------------------------------------------
    def _contains(self, handle: Any) -> bool:
        return any(h is handle for h, _ in self._queue)

    def _issue_until(self, last: Any) -> None:
        """Issue queued entries in order, through ``last`` (None: all of them)."""
        queue = self._queue
        while queue:
            handle, issue = queue.popleft()
            failed = self._failed  # set by ``stop`` without the lock: the job failed meanwhile
            if failed is not None:
                if handle is not None:
                    handle.settle(error=failed)
            elif handle is None or not handle.failed:
                issue()
            if last is not None and handle is last:
                return


__all__ = ["IssueOrder", "in_backward"]
