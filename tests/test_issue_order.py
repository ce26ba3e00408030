"""The issue order of one device (gpucomm/dataplane/order.py), rule by rule: agreed work is issued
at once unless a schedule step (an epoch) is open; a step waits for what this rank submitted
before it and issues that first; a waiter inside backward issues in place, up to its own
collective; a waiter outside backward first finishes the open step; a poll inside backward issues
nothing; a failure fails what is queued."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpucomm.dataplane.handles import Handle, Issued
from gpucomm.dataplane.order import IssueOrder, in_backward
from gpucomm.errors import CollectiveError


class _Request:
    def __init__(self, name: str) -> None:
        self.name = name

    def describe(self) -> str:
        return f"allreduce '{self.name}'"


class _Owner:
    timeout = 5.0

    def failure(self):
        return None

    def wait_ready(self, handle, timeout):
        raise AssertionError("these handles are agreed before anyone waits")


def _handle(name: str) -> Handle:
    return Handle(_Request(name), _Owner())


def _order(failure=lambda: None, timeout: float = 5.0) -> IssueOrder:
    return IssueOrder("cuda:0", timeout=timeout, failure=failure)


def _agree(order: IssueOrder, handle: Handle, log: list[str]) -> None:
    def issue() -> None:
        log.append(handle.request.name)
        handle.settle(issued=Issued(finalize=lambda: handle.request.name))

    order.agreed(handle, issue)


def test_agreed_work_is_issued_at_once_without_an_open_step():
    order, log = _order(), []
    a = _handle("a")
    _agree(order, a, log)
    assert log == ["a"] and a.issued


def test_work_agreed_during_a_step_waits_for_its_end_in_answer_order():
    order, log = _order(), []
    token = order.open_epoch(flush=lambda: None)
    log.append("bucket.0")
    a, b = _handle("a"), _handle("b")
    _agree(order, a, log)
    _agree(order, b, log)
    log.append("bucket.1")
    assert not a.issued and a.agreed() and order.deferred == 2
    order.close_epoch(token)
    assert log == ["bucket.0", "bucket.1", "a", "b"]


def test_a_step_first_waits_for_and_issues_what_this_rank_submitted_before_it():
    order, log = _order(), []
    early = _handle("early")
    order.submitted(early)
    opened = threading.Event()

    def step() -> None:
        token = order.open_epoch(flush=lambda: None)
        log.append("bucket.0")
        opened.set()
        order.close_epoch(token)

    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.2)
    assert not opened.is_set()  # the answer has not come: the step may not start before it
    _agree(order, early, log)
    t.join(5)
    assert log == ["early", "bucket.0"]


def test_a_step_waiting_for_an_answer_that_never_comes_says_why():
    order = _order(timeout=0.2)
    never = _handle("never")
    order.submitted(never)
    with pytest.raises(CollectiveError, match="submitted before an optimizer step must be submitted before"):
        order.open_epoch(flush=lambda: None)


def test_a_step_stops_waiting_once_the_job_failed():
    failed = CollectiveError("rank 2 died")
    order = _order(failure=lambda: failed)
    order.submitted(_handle("early"))
    with pytest.raises(CollectiveError, match="rank 2 died"):
        order.open_epoch(flush=lambda: None)


def test_a_waiter_outside_backward_finishes_the_step_first():
    order, log = _order(), []
    tokens = []

    def flush() -> None:
        log.append("rest-of-step")
        order.close_epoch(tokens.pop())

    tokens.append(order.open_epoch(flush))
    metric = _handle("metric")
    _agree(order, metric, log)
    assert not metric.issued
    assert metric.wait() == "metric"  # a synchronous allreduce between backward() and step()
    assert log == ["rest-of-step", "metric"]
    assert not order.epoch_open


def test_a_waiter_inside_backward_issues_in_place_up_to_its_own_collective():
    """SyncBatchNorm's backward waits for its allreduce in the middle of backward: issued at that
    point (the same on every rank), after what was answered before it, not what came after."""
    order, log = _order(), []
    token = order.open_epoch(flush=lambda: log.append("FLUSHED"))
    before, mine, after = _handle("before"), _handle("syncbn"), _handle("after")
    results = {}

    def hook(grad):
        assert in_backward()
        _agree(order, before, log)
        _agree(order, mine, log)
        _agree(order, after, log)
        results["value"] = mine.wait()
        results["after_issued"] = after.issued
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(hook)
    (x * 3).sum().backward()
    assert not in_backward()
    assert results == {"value": "syncbn", "after_issued": False}
    assert log == ["before", "syncbn"]
    order.close_epoch(token)
    assert log == ["before", "syncbn", "after"]


def test_a_poll_inside_backward_issues_nothing():
    order, log = _order(), []
    token = order.open_epoch(flush=lambda: log.append("FLUSHED"))
    h = _handle("async")
    _agree(order, h, log)
    polled = {}

    def hook(grad):
        polled["done"] = h.poll()
        return grad

    x = torch.ones(1, requires_grad=True)
    x.register_hook(hook)
    x.sum().backward()
    assert polled == {"done": False} and log == []
    order.close_epoch(token)
    assert log == ["async"] and h.poll()


def test_a_failure_fails_what_is_queued():
    order, log = _order(), []
    order.open_epoch(flush=lambda: None)
    h = _handle("queued")
    _agree(order, h, log)
    order.fail(CollectiveError("rank 1 died"))
    with pytest.raises(CollectiveError, match="rank 1 died"):
        h.wait()
    assert log == []


def test_a_waiter_racing_a_failure_gets_the_failure_not_an_internal_error(monkeypatch):
    """``fail`` takes the queue and settles its handles as one step under the order's lock: a waiter that
    takes the lock in between must not find its handle neither queued, issued nor failed (it raised
    "internal error ... agreed but never issued")."""
    order, log = _order(), []
    token = order.open_epoch(flush=lambda: None)
    h = _handle("queued")
    _agree(order, h, log)
    settle, entered, go = Handle.settle, threading.Event(), threading.Event()

    def slow_settle(self, **kw):  # the failing thread pauses while it settles
        if threading.current_thread().name == "failer":
            entered.set()
            go.wait(5)
        return settle(self, **kw)

    monkeypatch.setattr(Handle, "settle", slow_settle)
    failer = threading.Thread(target=order.fail, args=(CollectiveError("rank 1 died"),), name="failer")
    failer.start()
    assert entered.wait(5)
    seen: list[BaseException] = []

    def waiter() -> None:
        try:
            order.close_epoch(token)  # nothing left open: the waiter takes the in-place path
            h.wait()
        except BaseException as e:  # noqa: BLE001 - what the waiter got is the test's result
            seen.append(e)

    w = threading.Thread(target=waiter)
    w.start()
    w.join(0.3)  # with the fix the waiter waits for the lock the failing thread holds
    go.set()
    failer.join(5)
    w.join(5)
    assert len(seen) == 1 and "rank 1 died" in str(seen[0]), seen
    assert log == []


def test_a_stand_in_without_a_handle_is_ordered_too():
    order, log = _order(), []
    token = order.open_epoch(flush=lambda: None)
    order.agreed(None, lambda: log.append("zeros"))
    assert log == []
    order.close_epoch(token)
    assert log == ["zeros"]


def test_a_backends_own_timeout_in_a_fixed_schedule_step_gets_the_steps_context():
    """MPI's timeout is a CollectiveError of its own, which the handle passed on as it was: the rank waiting
    in a DistributedOptimizer step read "MPI allreduce of 216 float32 ... did not complete", with neither the
    bucket's name nor what a fixed-schedule step needs (a Gloo failure had both). A shutdown is left alone."""
    from gpucomm.errors import ShutdownError

    class _Work:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def wait(self, timeout, poll) -> None:
            raise self.error

    class _Schedule(_Owner):
        def transport_hint(self) -> str:
            return ". This collective is a step of a DistributedOptimizer's fixed schedule"

    timeout = CollectiveError("MPI allreduce of 216 float32 (sum) did not complete within 2 s. Fix: raise it.")
    for owner, error, expected in (
            (_Schedule(), timeout, "allreduce 'bucket' failed: MPI allreduce of 216 float32 (sum) did not complete "
                                   "within 2 s. Fix: raise it. This collective is a step of a DistributedOptimizer's "
                                   "fixed schedule"),
            (_Owner(), timeout, str(timeout)),  # a negotiated op: no hint to add
            (_Schedule(), ShutdownError("pending when gpucomm shut down"), "pending when gpucomm shut down")):
        owner.has_peers = False  # no cause to wait for
        handle = Handle(_Request("bucket"), owner)
        handle.settle(issued=Issued(works=[_Work(error)]))
        with pytest.raises(CollectiveError) as raised:
            handle.wait()
        assert str(raised.value) == expected, str(raised.value)
