"""The control round's poll yields to autograd (issue 35): while a gradient-hook backward runs, a
waiting caller sleeps in ``select`` instead of polling, because every poll takes the GIL back from
the hook threads that launch the buckets."""

from __future__ import annotations

import os
import select
import socket
import threading

import pytest

from gpucomm.control import channel
from gpucomm.counters import COUNTERS
from gpucomm.dataplane import activity
from tests.harness import run_ranks


@pytest.fixture(autouse=True)
def no_backward():
    activity.reset_backward()
    yield
    activity.reset_backward()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


class CountingSelect:
    """``select.select`` that counts zero-timeout polls (and runs ``on_poll`` after each)."""

    def __init__(self, on_poll=lambda n: None) -> None:
        self.real, self.polls, self.sleeps, self.on_poll = select.select, 0, 0, on_poll

    def __call__(self, r, w, x, timeout=None):
        result = self.real(r, w, x, timeout)
        if timeout == 0.0:
            self.polls += 1
            self.on_poll(self.polls)
        else:
            self.sleeps += 1
        return result


def test_the_backward_count_nests_and_never_goes_below_zero():
    assert not activity.backward_running()
    activity.backward_ended()  # unmatched: ignored
    activity.backward_started()
    assert activity.backward_running()
    activity.backward_started()  # a second optimizer, or a second device's backward
    activity.backward_ended()
    assert activity.backward_running()
    activity.backward_ended()
    activity.backward_ended()
    assert not activity.backward_running()
    activity.backward_started()
    assert activity.backward_running()  # the extra end did not leave a debt


def test_readable_polls_when_no_backward_runs(monkeypatch, pair):
    a, _ = pair
    counting = CountingSelect()
    monkeypatch.setattr(channel.select, "select", counting)
    assert channel.readable([a], 0.2, spin=0.005) == []
    assert counting.polls > 1 and counting.sleeps <= 1  # 0: descheduled past the whole timeout while polling


def test_readable_does_not_poll_while_a_backward_runs(monkeypatch, pair):
    a, b = pair
    counting = CountingSelect()
    monkeypatch.setattr(channel.select, "select", counting)
    before = COUNTERS.spin_skipped_backward
    activity.backward_started()
    assert channel.readable([a], 0.02, spin=0.005) == []
    assert (counting.polls, counting.sleeps) == (0, 1)
    b.sendall(b"x")
    assert channel.readable([a], 1.0, spin=0.005) == [a]  # still answers, from the sleeping select
    assert (counting.polls, counting.sleeps) == (0, 2)
    assert COUNTERS.spin_skipped_backward == before + 2


def test_a_poll_stops_as_soon_as_a_backward_begins(monkeypatch, pair):
    a, _ = pair
    counting = CountingSelect(on_poll=lambda n: activity.backward_started() if n == 3 else None)
    monkeypatch.setattr(channel.select, "select", counting)
    before = COUNTERS.spin_skipped_backward
    assert channel.readable([a], 0.2, spin=10.0) == []  # would poll for all 200 ms without the backward
    assert (counting.polls, counting.sleeps) == (3, 1)
    assert COUNTERS.spin_skipped_backward == before + 1


def wait_while_a_backward_runs(backward: bool, rounds: int) -> dict:
    """A rank's body: ``rounds`` allreduces that rank 1 waits for (rank 0 comes late to each), with
    rank 1 in a backward or not; the ``spin`` every wait of rank 1's own thread asked for."""
    import time

    import torch

    import gpucomm.torch as hvd

    hvd.init()
    spins: list[float] = []
    real = channel.readable

    def recording(socks, timeout, spin=0.0):
        if threading.current_thread() is threading.main_thread() and timeout > 0.0:
            spins.append(spin)
        return real(socks, timeout, spin)

    channel.readable = recording
    before = COUNTERS.spin_skipped_backward
    if backward and hvd.rank() == 1:
        activity.backward_started()
    try:
        for i in range(rounds):
            if hvd.rank() == 0:
                time.sleep(0.03)
            hvd.allreduce(torch.ones(4), name=f"spin.{i}")
    finally:
        channel.readable = real
        activity.reset_backward()
        skipped = COUNTERS.spin_skipped_backward - before
        hvd.shutdown()
    return {"spins": spins, "skipped": skipped}


@pytest.mark.parametrize("backward", [False, True], ids=["idle", "in-backward"])
def test_a_waiting_caller_polls_only_outside_backward(backward):
    rounds = 3
    _, r1 = run_ranks(wait_while_a_backward_runs, 2, args=(backward, rounds), env={"GPUCOMM_SPIN_US": "500"},
                      timeout=60)
    assert r1["spins"], "rank 1 never waited on the control round"
    if backward:
        assert max(r1["spins"]) == 0.0, r1
        assert r1["skipped"] >= rounds, r1  # every wait decided once, at its start
    else:
        assert max(r1["spins"]) > 0.0 and r1["skipped"] == 0, r1


def test_a_socket_closed_by_another_thread_does_not_end_the_waiter():
    """Issue 36, finding 6: rank 0's control thread took the hub's socket list, another thread closed
    a socket of a worker that had left, and ``select`` raised ``OSError: [Errno 9] Bad file
    descriptor``, ending the thread ("Exception in thread gpucomm-control") at shutdown. Reproduced
    here without a race: the fd is closed under the socket object, as that thread's close does."""
    gone_a, gone_b = socket.socketpair()
    live_a, live_b = socket.socketpair()
    try:
        os.close(gone_a.fileno())  # closed under the socket object, as the hub's thread does
        live_b.sendall(b"x")
        # before the fix: OSError: [Errno 9] Bad file descriptor
        assert channel.readable([gone_a, live_a], 0.1) == [live_a]
        assert channel.readable([gone_a, live_a], 0.1, spin=0.001) == [live_a]  # the polling path too
        assert channel.readable([gone_a], 0.01) == []
    finally:
        for s in (gone_b, live_a, live_b):
            s.close()
        try:
            gone_a.detach()
        except OSError:
            pass
