"""Elastic teardown (issue 36, finding 8): a Gloo group of a failed round may not outlive its round with
work pending on it or a connection open, or a peer that exits normally later kills the survivor at its
own exit (a Gloo thread that needs the GIL while the interpreter finalizes: SIGABRT or SIGSEGV).

The scenario is reduced to two ranks and one group (``tests/ranks/elastic_teardown.py``); whole elastic
jobs run it in ``benchmarks/elastic_stress.py`` (``--scenario fault|rank|internal``) and ``tests/test_elastic.py``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from gpucomm.backends.base import BackendOp
from gpucomm.backends.gloo import GlooDevice, gloo_group, open_sockets
from gpucomm.bootstrap.rendezvous import RendezvousClient
from gpucomm.errors import CollectiveError
from tests.harness import run_rank_scripts, run_ranks
from tests.ranks import elastic_teardown

SETTLE_S = 30.0  # generous deadline for what must happen "at once" (never a measured duration)


@pytest.mark.parametrize("mode", ["wait", "callback"])
def test_a_survivor_outlives_a_peer_that_exits_during_its_teardown(tmp_path, mode):
    signal_file = str(tmp_path / "rank0-finalizing")
    results = run_rank_scripts([elastic_teardown.__file__, signal_file, mode], 2, timeout=90)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} exited with {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert "terminate called" not in r.stderr and "IoException" not in r.stderr, r.stderr
    assert "pending work done: True" in results[0].stdout, results[0].stdout
    if mode == "callback":
        assert "callback ran: True" in results[0].stdout, results[0].stdout
    assert "rank 1: leaving the job normally" in results[1].stdout
    assert results[0].leftovers == []


def _client() -> RendezvousClient:
    return RendezvousClient(os.environ["GPUCOMM_RENDEZVOUS_ADDR"], int(os.environ["GPUCOMM_RENDEZVOUS_PORT"]),
                            bytes.fromhex(os.environ["GPUCOMM_SECRET"]))


def _rank_size() -> tuple[int, int]:
    return int(os.environ["GPUCOMM_RANK"]), int(os.environ["GPUCOMM_SIZE"])


def _abort_with_work_pending() -> dict:
    """Rank 0 aborts a 3-rank group while an allreduce the others never join is pending on it."""
    rank, size = _rank_size()
    client = _client()
    group = gloo_group(client, "abort/", rank, size, timeout=60.0, device=GlooDevice(hostname="127.0.0.1"))
    connections = group.connections
    warm = torch.ones(2)
    group.allreduce(warm, warm, op=BackendOp.SUM).wait(60.0)
    outcome = {"connections": len(connections)}
    if rank == 0:
        work = group.allreduce(torch.ones(2), torch.ones(2), op=BackendOp.SUM)
        group.close(abort=True)
        outcome["done_after_close"] = work.done()
        try:
            work.wait(60.0)
            outcome["wait"] = "returned"
        except RuntimeError as e:
            outcome["wait"] = type(e).__name__
        deadline = time.monotonic() + SETTLE_S
        while connections & set(open_sockets()) and time.monotonic() < deadline:
            time.sleep(0.01)  # Gloo's event loop closes each connection once it has read its end
        outcome["open_after_close"] = len(connections & set(open_sockets()))
        client.set("abort/closed", b"1")
    else:
        client.wait(["abort/closed"], 60.0)
        work = group.allreduce(torch.ones(2), torch.ones(2), op=BackendOp.SUM)  # rank 0's side is gone
        try:
            work.wait(60.0, failed=lambda: False)
            outcome["peer"] = "completed"
        except (RuntimeError, CollectiveError) as e:
            outcome["peer"] = "failed: " + str(e).splitlines()[0][:80]
        group.close(abort=True)
    client.close()
    return outcome


def test_an_aborted_group_ends_its_pending_work_and_closes_its_connections():
    """What ``close(abort=True)`` guarantees (torch's own ``abort()`` does nothing for Gloo): the pending
    work has ended when it returns, the group's connections are closed, and its peers see them end."""
    outcomes = run_ranks(_abort_with_work_pending, 3, timeout=120)
    assert all(o["connections"] == 2 for o in outcomes), outcomes  # one per peer, found when the group was built
    zero = outcomes[0]
    assert zero["done_after_close"] is True, zero
    assert zero["wait"] == "RuntimeError", zero  # the transfer's own error ("Connection closed ...")
    assert zero["open_after_close"] == 0, zero
    for o in outcomes[1:]:
        assert o["peer"].startswith("failed"), o  # at once, not after Gloo's 60 s timeout


def _wait_outcomes() -> dict:
    """``GlooWork.wait`` with ``failed``: a transfer that completes late, a caller released."""
    rank, size = _rank_size()
    client = _client()
    group = gloo_group(client, "wait/", rank, size, timeout=60.0, device=GlooDevice(hostname="127.0.0.1"))
    t = torch.full((3,), float(rank + 1))
    group.allreduce(t, t, op=BackendOp.SUM).wait(60.0, failed=lambda: False)
    outcome = {"sum": t.tolist()}
    if rank == 0:
        work = group.allreduce(torch.ones(1), torch.ones(1), op=BackendOp.SUM)  # rank 1 joins it late
        client.set("wait/go", b"1")
        work.wait(60.0, failed=lambda: False)
        outcome["late"] = "completed"
        stuck = group.allreduce(torch.ones(1), torch.ones(1), op=BackendOp.SUM)  # never joined
        try:
            stuck.wait(60.0, failed=lambda: True)
        except CollectiveError:
            outcome["released"] = True
        client.set("wait/released", b"1")
    else:
        client.wait(["wait/go"], 60.0)
        time.sleep(0.5)  # rank 0 is waiting across more than one slice
        group.allreduce(torch.ones(1), torch.ones(1), op=BackendOp.SUM).wait(60.0)
        client.wait(["wait/released"], 60.0)
    group.close(abort=True)
    client.close()
    return outcome


def test_a_wait_ends_with_the_transfer_or_when_the_job_failed():
    outcomes = run_ranks(_wait_outcomes, 2, timeout=120)
    assert outcomes[0]["sum"] == [3.0, 3.0, 3.0] and outcomes[1]["sum"] == [3.0, 3.0, 3.0]
    assert outcomes[0]["late"] == "completed" and outcomes[0]["released"] is True, outcomes[0]
