"""The hot path, proved by counters (``hvd.stats()``), never by timings: a DistributedOptimizer in
steady state sends no control message, a cycle of cached ad-hoc ops costs a handful of control
rounds, a one-rank job negotiates nothing and has no control thread, a cached op stays cheap in
Python calls, and the optimizer's layout is agreed again only when the trainable set changes."""

from __future__ import annotations

import pytest

from tests.ranks import hot_path_scenarios as sc
from tests.harness import run_ranks

SMALL_BUCKETS = {"GPUCOMM_FUSION_THRESHOLD": "256", "GPUCOMM_FUSION_FIRST_BUCKET": "128"}  # several buckets


@pytest.mark.parametrize("size", [2, 3])
def test_steady_state_optimizer_steps_send_no_control_message(size):
    for rank, seen in enumerate(run_ranks(sc.steady_state_steps, size, env=SMALL_BUCKETS)):
        d = seen["delta"]
        assert seen["buckets"] > 1
        assert d["control_rounds"] == 0 and d["negotiated"] == 0, (rank, d)
        assert d["schedule_steps"] == 20 and d["collectives"] == 20 * seen["buckets"], (rank, d)
        assert d["layout_checks"] == 0, (rank, d)
        assert seen["diff"] <= 1e-5, (rank, seen["diff"])


@pytest.mark.parametrize("size", [2, 3])
def test_a_cycle_of_cached_ad_hoc_ops_costs_a_handful_of_control_rounds(size):
    """50 async ops inside one 50 ms cycle (far longer than submitting them takes), then waited on."""
    for rank, seen in enumerate(run_ranks(sc.cached_cycle, size, env={"GPUCOMM_CYCLE_TIME": "50"})):
        cached = seen["cached"]
        assert cached["negotiated"] == 50 and cached["cache_hits"] == 50, (rank, cached)
        assert 1 <= cached["control_rounds"] <= 5, (rank, cached)  # barrier included
        assert seen["uncached"]["cache_hits"] == 0, (rank, seen["uncached"])


def test_one_rank_job_runs_inline_without_control_plane():
    [seen] = run_ranks(sc.one_rank_inline, 1)
    d = seen["delta"]
    assert seen["no_controller"] and seen["threads"] == [], seen
    assert d["control_rounds"] == 0 and d["negotiated"] == 0, d
    # every op ran where its data lies: no backend call at all (a copy, or nothing in place)
    assert d["local_ops"] >= 9 and d["collectives"] == 0, d


def test_python_calls_per_cached_op_in_a_one_rank_job():
    """At most 30 calls per cached op (issue 35; 203 before the fixed schedule, 32-37 before a one-rank
    job computed its ops where the data lies, 14-22 since); the counts are deterministic, so this
    guards the fast path against regressions."""
    [calls] = run_ranks(sc.python_calls_per_cached_op, 1)
    assert all(0 < c <= 30 for c in calls.values()), calls


def test_layout_is_agreed_again_only_when_the_trainable_set_changes():
    for rank, seen in enumerate(run_ranks(sc.trainable_set_changes, 2, env=SMALL_BUCKETS)):
        assert seen["checks"] == [1, 0, 1, 0, 1, 0], (rank, seen)  # step 0: the watched step's new cut
        assert [r > 0 for r in seen["rounds"]] == [True, False, True, False, True, False], (rank, seen)
        assert seen["diff"] <= 1e-5, (rank, seen["diff"])


def test_buckets_are_cut_where_backward_pauses_after_the_first_step():
    """Pure planning: gradients arriving in two bursts become two buckets, whatever the cap."""
    import torch

    from gpucomm.dataplane.fusion import plan_by_readiness

    params = [torch.zeros(1000) for _ in range(6)]
    ready = [900.0, 880.0, 870.0, 20.0, 10.0, 0.0]  # the last three parameters' gradients come first
    plan = plan_by_readiness(params, ready, bucket_cap_bytes=1 << 30, min_bucket_bytes=1, env={})
    assert [b.param_indices for b in plan] == [(5, 4, 3), (2, 1, 0)]
    plan = plan_by_readiness(params, ready, bucket_cap_bytes=8000, min_bucket_bytes=1, env={})  # 2 per bucket
    assert [b.param_indices for b in plan] == [(5, 4), (3,), (2, 1), (0,)]
    plan = plan_by_readiness(params, [None] * 6, bucket_cap_bytes=1 << 30, env={})  # nothing seen: one bucket
    assert [b.param_indices for b in plan] == [(5, 4, 3, 2, 1, 0)]


def test_in_place_prescale_is_applied_once_and_a_refused_op_leaves_the_tensor_alone():
    for seen in run_ranks(sc.in_place_prescale, 2):
        assert seen[4] == [1.0, 1.0] and seen[8192] == [1.0, 1.0], seen  # 2 ranks x 1 x 0.5
        assert seen["after_mismatch"] == [1.0], seen


def test_ranks_planning_other_buckets_fail_at_construction_on_every_rank():
    messages = run_ranks(sc.mismatched_bucket_layout, 2)
    for message in messages:
        assert "ranks disagree on the gradient buckets" in message, message
        assert "GPUCOMM_FUSION_THRESHOLD" in message
