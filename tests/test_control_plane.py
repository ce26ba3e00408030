"""The control plane end to end, in 2 and 3 real processes on CPU: errors when ranks disagree,
duplicate names, ordering, the response cache, the stall inspector, join, process sets, and ranks
that die while the others wait. The rank-side halves live in ``tests/ranks/control_scenarios.py``.

Three ranks where a third rank shows something two cannot (ranks grouped by value, a missing rank
among several, sets of a subset); two elsewhere. Time bounds only catch hangs: each is at least ten
times what the behaviour needs (the benchmarks measure the real figures)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.ranks import control_scenarios as sc
from tests.harness import run_rank_scripts, run_ranks

# How fast a mismatch or a dead peer becomes an error is measured by benchmarks/control_plane.py (within 2 s); the
# tests here assert the error's cause, which a rank that waited out GPUCOMM_TIMEOUT would not be given.
STALL_ENV = {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def _who(size: int) -> str:
    """How a message names the ranks that agree with rank 0 (every rank but 1)."""
    return "rank 0" if size == 2 else "ranks 0, 2"


# =============================================================================================
# 1. mismatches: an error on every rank, fast, naming ranks and values; the job goes on


def test_mismatch_raises_on_every_rank_naming_ranks_and_values():
    size = 3
    results = run_ranks(sc.mismatches, size, timeout=90)
    who = _who(size)
    expected = {
        "shape": f"tensor shapes: {who} sent [2]; rank 1 sent [3].",
        "shape-big": f"tensor shapes: {who} sent [6000]; rank 1 sent [6001].",
        "dtype": f"tensor types: {who} sent float32; rank 1 sent float64.",
        "op": f"reduction ops: {who} sent hvd.Sum; rank 1 sent hvd.Max.",
        "root": f"root ranks: {who} sent 0; rank 1 sent 1.",
        "prescale": f"prescale and/or postscale factors: {who} sent prescale=1, postscale=1; rank 1 sent prescale=2, "
                    f"postscale=1.",
        "postscale-big": f"{who} sent prescale=1, postscale=1; rank 1 sent prescale=1, postscale=0.5.",
        "splits": f"splits: {who} sent no splits; rank 1 sent splits.",
        "count": f"number of tensors: {who} sent 1; rank 1 sent 2.",
    }
    for rank, seen in enumerate(results):
        assert set(seen) == set(expected), seen
        for case, fragment in expected.items():
            _, kind, message = seen[case]
            assert kind == "CollectiveError", (rank, case, kind)  # a RuntimeError, as Horovod raises
            op_kind = {"root": "broadcast", "splits": "alltoall"}.get(case, "allreduce")
            assert f"{op_kind.upper()} '{op_kind}.{case}'" in message, message
            assert fragment in message, (rank, case, message)
    # every rank got the very same explanation
    messages = [{case: seen[case][2] for case in expected} for seen in results]
    assert all(m == messages[0] for m in messages)


def test_duplicate_in_flight_name_fails_only_on_that_rank():
    messages = run_ranks(sc.duplicate_name, 2, timeout=60)
    assert "another operation named 'allreduce.dup' is still in flight on this rank" in messages[0]
    assert messages[1:] == [None]


# =============================================================================================
# 2. order and the response cache


@pytest.mark.parametrize("size, env", [(3, {}), (3, {"GPUCOMM_CACHE_CAPACITY": "0"})], ids=["3", "3-no-cache"])
def test_async_ops_submitted_in_different_orders_all_complete_correctly(size, env):
    run_ranks(sc.out_of_order, size, timeout=60, env=env)


def test_burst_of_named_allreduces_costs_few_control_rounds():
    """100 async allreduces, twice (the second burst is all response-cache hits), with the
    coordinator reducing them and with the data plane (GPUCOMM_INLINE_BYTES=0). A cycle far longer
    than a burst takes to submit (10 s; waiting on a handle sends at once) puts each burst in one
    frame however loaded the machine is: the bound is about batching requests, not CPU speed. The
    ranks also check cached names whose requests change (new allgather rows; a shape mismatch,
    then the old shape again)."""
    frames = run_ranks(sc.cache_bursts, 3, timeout=90, env={"GPUCOMM_CYCLE_TIME": "10000"})
    for rank, per_mode in enumerate(frames):
        for mode, bursts in per_mode.items():
            assert len(bursts) == 2 and all(1 <= f <= 3 for f in bursts), (rank, mode, bursts)


# =============================================================================================
# 3. the stall inspector


def test_stall_is_reported_then_becomes_an_error_on_every_rank():
    results = run_ranks(sc.stall_shutdown, 3, timeout=90, env=STALL_ENV)
    rank0 = results[0]
    assert rank0["warnings"], "rank 0 logged no stall warning"
    first = rank0["warnings"][0]
    assert "allreduce.forgotten: waiting 1 s for ranks [1]" in first, first
    assert "Missing ranks:\n  1: [allreduce.forgotten]" in first, first
    assert all(not r["warnings"] for r in results[1:]), "only rank 0 logs stall warnings"
    for rank, seen in enumerate(results):
        assert "the stall inspector stopped the job after 3 s" in seen["error"], (rank, seen["error"])
        assert "1: [allreduce.forgotten]" in seen["error"]
        assert seen["later"] == seen["error"], "later collectives fail with the same cause"


def test_stall_warning_without_shutdown_lets_the_job_finish():
    results = run_ranks(sc.stall_warning_then_recover, 2, timeout=60, env={"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1"})
    warnings = results[0]["warnings"]
    assert any("allreduce.forgotten: waiting" in w and "Missing ranks:\n  1: [allreduce.forgotten]" in w
               for w in warnings), warnings
    assert all("Set GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS to turn a stall into an error." in w for w in warnings)
    assert results[1]["warnings"] == []
    assert results[0]["sum"] == results[1]["sum"] == 3.0  # rank 0 waited for the late rank's share, then finished


def test_stall_check_disable_logs_nothing():
    results = run_ranks(sc.stall_warning_then_recover, 2, timeout=60,
                        env={"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_STALL_CHECK_DISABLE": "1"})
    # the same late rank as above, whose wait the previous test sees warned about: here nothing is logged
    assert results[0]["warnings"] == [] and results[0]["sum"] == 3.0


def test_timeout_on_another_rank_names_the_missing_rank():
    """Rank 1's own wait times out (GPUCOMM_TIMEOUT=3); the coordinator's stall reports told it
    which rank was missing."""
    messages = run_ranks(sc.stall_timeout_names_missing_rank, 2, timeout=60,
                         env={"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_TIMEOUT": "3"})
    assert messages[0] is None
    assert "allreduce 'allreduce.late'" in messages[1] and "was not negotiated within 3 s" in messages[1]
    assert "ranks [0] have not submitted it" in messages[1], messages[1]


def test_early_join_is_not_a_stall():
    """Rank 0 joins at once while rank 1 trains 5 s more under a 3 s stall shutdown: the job
    finishes (a rank waiting in join() is not stalled)."""
    lasts = run_ranks(sc.early_join_under_stall_shutdown, 2, timeout=60, env=STALL_ENV)
    assert lasts == [1, 1]


# =============================================================================================
# 4. join


def test_join_with_uneven_steps():
    """Rank r runs 3 + r steps; exact Sum/Average/reducescatter/grouped values are checked on each
    rank, including through the data plane where joined ranks stand in with zeros."""
    size = 3
    lasts = run_ranks(sc.join_uneven_steps, size, timeout=90)
    assert lasts == [size - 1] * size


def test_data_movement_after_a_peer_joined_fails_on_the_submitting_ranks():
    size = 2
    results = run_ranks(sc.join_then_data_movement, size, timeout=90)
    lasts = {last for last, _ in results}
    assert len(lasts) == 1 and lasts <= set(range(1, size)), results
    assert results[0][1] == {}, "the joined rank saw no error"
    for rank, (_, errors) in enumerate(results[1:], start=1):
        for kind in ("allgather", "broadcast", "alltoall"):
            assert f"{kind.upper()} '{kind}." in errors[kind] and "rank 0 already called join()" in errors[kind], \
                (rank, errors)
        assert "op=hvd.Min cannot run: rank 0 already called join()" in errors["min"]


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_with_uneven_batches_then_join(size):
    """Joined ranks stand in for the others' fixed-schedule steps with zeros (a training flag in
    bucket 0 tells them when every rank has joined)."""
    results = run_ranks(sc.train_uneven_then_join, size, timeout=120)
    want = sc.reference_training({r: 4 + r for r in range(size)}, size)
    for rank, (last, params) in enumerate(results):
        assert last == size - 1
        for got, expected in zip(params, want):
            assert torch.allclose(torch.tensor(got), expected, atol=1e-6), (rank, got, expected)
    # the uneven steps matter: had every rank trained on every step, the parameters would differ
    everyone = sc.reference_training({r: 4 + size - 1 for r in range(size)}, size)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, everyone))


# =============================================================================================
# 5. process sets (3 ranks)


def test_static_process_sets_and_optimizer_on_a_subset():
    results = run_ranks(sc.static_process_sets, 3, timeout=90)
    assert "Rank 1 is not a member of the provided process set [0, 2]" in results[1]["non_member"]
    assert "Rank 1 is not a member" in results[1]["non_member_barrier"]
    for rank in (0, 2):
        assert "root_rank=1 is not a member of the process set [0, 2]" in results[rank]["root_not_member"]
    assert all("add_process_set needs dynamic process sets" in r["add_static"] for r in results)
    assert results[0]["optimizer_non_member"] == "SGD"  # outside the set: a plain local optimizer
    want = sc.reference_training({1: 3, 2: 3}, 3, members=[1, 2])
    for rank in (1, 2):
        for got, expected in zip(results[rank]["params"], want):
            assert torch.allclose(torch.tensor(got), expected, atol=1e-6), (rank, got, expected)


def test_dynamic_process_sets():
    results = run_ranks(sc.dynamic_process_sets, 3, timeout=90)
    for seen in results:
        assert "add_process_set([0, 1]): a process set with these ranks is already registered (id 1)" in seen["duplicate"]
        assert "already registered (id 0)" in seen["global_again"]
        assert "process set id 1 still has operations in flight (allreduce.busy)" in seen["busy"]
        assert "is not registered" in seen["removed"]
        assert "the global process set cannot be removed" in seen["remove_global"]


# =============================================================================================
# 6. a rank that dies does not hang the others


def _run_scripts(size: int, argv: list[str], timeout: float = 60.0) -> list[tuple[int, str, str]]:
    """Run ``python -m tests.ranks.control_scenarios *argv`` as every rank (real scripts, so an uncaught
    exception goes through sys.excepthook); (rc, stdout, stderr) per rank, every process reaped."""
    ranks = run_rank_scripts(["-m", "tests.ranks.control_scenarios", *argv], size, timeout=timeout)
    assert not ranks[0].leftovers, ranks[0].leftovers
    return [(r.returncode, r.stdout, r.stderr) for r in ranks]


def _report(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


@pytest.mark.parametrize("size, mode, dying", [(2, "exit", 1), (3, "exit", 0), (2, "raise", 1), (2, "raise", 0)])
def test_dead_rank_fails_the_waiting_ranks_fast(size, mode, dying):
    # a job that waited out GPUCOMM_TIMEOUT would fail with a timeout, not with the dead rank's cause asserted below
    ranks = _run_scripts(size, ["dies_while_others_wait", mode, str(dying)])
    rc, _, stderr = ranks[dying]
    if mode == "exit":
        assert rc == 3, (rc, stderr)
    else:
        assert rc == 1 and f"ValueError: rank {dying} gave up" in stderr, (rc, stderr)
    for rank, (rc, stdout, stderr) in enumerate(ranks):
        if rank == dying:
            continue
        assert rc == 0, (rank, rc, stderr)
        seen = _report(stdout)
        if mode == "raise":  # the uncaught exception was reported before the rank went away
            assert f"rank {dying} failed: ValueError: rank {dying} gave up" in seen["error"], seen["error"]
        elif dying == 0:
            assert "the control connection to rank 0 (the coordinator) closed" in seen["error"], seen["error"]
        else:
            assert "rank 1 exited or crashed without shutting gpucomm down" in seen["error"], seen["error"]
        assert seen["later"] == seen["error"], "later collectives fail at once with the same cause"


@pytest.mark.parametrize("leaver", [1, 0])
def test_rank_that_shuts_down_fails_the_waiting_ranks_fast(leaver):
    """Also rank 0, the coordinator: the others' requests that need it failed only once it stopped serving
    (10 s later), blaming a closed connection ("exited or failed") though its process still ran."""
    results = run_ranks(sc.shutdown_while_others_wait, 2, args=(leaver,), timeout=60)
    assert results[leaver] is None
    for rank in (1 - leaver,):
        seen = results[rank]
        assert f"rank {leaver} has shut gpucomm down" in seen["error"], seen["error"]


def test_an_op_a_rank_submitted_before_it_shut_down_fails_on_the_others():
    """A rank that shut down never runs what it had submitted: the others' copy of that op must fail, naming
    it (it was answered "run" and waited in the transfer for a rank that was gone)."""
    results = run_ranks(sc.left_after_submitting, 2, env={"GPUCOMM_TIMEOUT": "20", "GPUCOMM_INLINE_BYTES": "0"},
                        timeout=120)
    assert results[0] is None
    assert "'allreduce.orphan' cannot complete: rank 0 has shut gpucomm down" in results[1], results[1]
