"""Hooks by arrival order: once a step's gradients all came through their hooks, only each bucket's
last gradient keeps a Python hook (the others' hooks are C calls). The results match the full batch
whatever the order of backward; a changed order, a gradient twice, ``no_sync``, Horovod's guards and
``set_backward_passes_per_step`` keep their behaviour."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.ranks import arrival_order_scenarios as sc

ONE_BUCKET = {"GPUCOMM_FUSION_THRESHOLD": str(1 << 20), "GPUCOMM_FUSION_BY_READINESS": "0",
              "GPUCOMM_INLINE_BYTES": "0"}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_changed_order_is_launched_complete_and_recorded_again(set_to_none):
    for seen in run_ranks(sc.order_changes_match_full_batch, 2, args=(set_to_none,), env=ONE_BUCKET):
        assert seen["diff"] <= 1e-5, seen
        # (steps by order, order changes) per step: 0 records, 1-2 by order, 3 swapped: changed; 4 records the
        # swapped order, 5 by it; 6 swapped back: changed; 7 records
        assert seen["per_step"] == [(0, 0), (1, 0), (1, 0), (0, 1), (0, 0), (1, 0), (0, 1), (0, 0)], seen
        assert seen["hooked"] == [True, True, True, False, True, True, False, True], seen


def test_gradients_that_come_twice_raise_as_horovods_do():
    for seen in run_ranks(sc.twice_by_order, 2, env=ONE_BUCKET):
        assert seen["last_hook"] == seen["twice"], seen  # in backward, as with a hook per gradient
        assert seen["after_last_hook"] is False and seen["again"] is True, seen
        assert seen["c_hooks"] == seen["twice"], seen  # at synchronize: the C hooks cannot raise
        assert seen["after_c_hooks"] is False and seen["steps"] == 7, seen  # 7 synchronizes, each counted, raised or not


def test_a_backward_that_reached_no_last_hook_opens_the_step_and_refuses_zero_grad():
    for seen in run_ranks(sc.zero_grad_after_partial_backward, 2, env=ONE_BUCKET):
        assert seen["refused"] == seen["expected"] and seen["opened"] is True, seen


def test_no_sync_and_more_passes_per_step_by_arrival_order():
    for seen in run_ranks(sc.no_sync_and_passes_by_order, 2, env=ONE_BUCKET):
        assert seen["hooked"] == [True] * 5 and seen["diff"] <= 1e-5, seen
        # (each pass a quarter of the batch: the sums round differently from the full batch's)
        assert seen["after_passes"] is False and seen["diff_passes"] <= 1e-4, seen
        assert seen["by_order_steps"] >= 4, seen


def test_a_negotiated_op_after_a_backward_of_middle_gradients_only_waits_for_the_step():
    env = {**ONE_BUCKET, "GPUCOMM_ISSUE_ORDER": "all", "GPUCOMM_TIMEOUT": "20"}
    opened = []
    for seen in run_ranks(sc.negotiated_op_after_middle_gradients_only, 2, env=env):
        assert seen["sum"] == [3.0] * 3 and seen["opened"] is True and seen["steps"] == 4, seen
        assert seen["opened_elsewhere"] is seen["opened_by_backward"], seen  # another thread's call opens nothing
        assert seen["after_step"] == (True, False, 0), seen  # after step(): nothing to open, nothing waits
        assert seen["deferred"] == 1, seen  # issued after the step's bucket (on a GPU: NCCL's order on every rank)
        opened.append(seen["opened_by_backward"])
    assert opened == [True, False]  # rank 1's C hooks opened nothing: its allreduce's submission did


@pytest.mark.parametrize("compression, bucket", [("none", "ViewBucket"), ("fp16", "FusedBucket"),
                                                 ("user", "CompressedBucket")])
def test_a_gradient_that_turns_sparse_by_arrival_order_is_handed_back_sparse(compression, bucket):
    for seen in run_ranks(sc.gradient_turning_sparse_by_order, 2, args=(compression,), env=ONE_BUCKET):
        assert seen["bucket"] == bucket, seen
        assert seen["diff"] <= (1e-5 if compression == "none" else 1e-2), seen
        # (hooks by arrival order at the step's start, the embedding's gradient sparse at synchronize)
        assert seen["per_step"] == [(False, False), (True, False), (True, False),
                                    (True, True), (False, True), (False, True)], seen


def test_a_sparse_parameter_unfrozen_later_is_averaged_and_handed_back_sparse():
    """(Before: ``copy_() between dense and sparse Tensors`` at the step that unfroze it, on every rank.)"""
    for seen in run_ranks(sc.sparse_parameter_unfrozen, 2, env=ONE_BUCKET):
        assert seen["handed"] == [None, None, True, True, True], seen
        assert seen["diff"] <= 1e-5, seen
