"""DistributedOptimizer at 2 ranks on CPU: equal to single-process full-batch training and to DDP,
overlap during backward, accumulation, compression, Horovod's errors, frozen parameters, state
broadcast and checkpoints."""

from __future__ import annotations

import pytest

import torch

from tests.ranks import optimizer_scenarios as sc
from tests.harness import run_ranks

SMALL_BUCKETS = {"GPUCOMM_FUSION_THRESHOLD": "256", "GPUCOMM_FUSION_FIRST_BUCKET": "128"}  # several buckets


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_two_ranks_on_half_batches_equal_one_process_on_the_full_batch(kind):
    diffs = run_ranks(sc.train_matches_full_batch, 2, args=(kind,), env=SMALL_BUCKETS)
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("groups", ["two", "lists"])
def test_explicit_groups(groups):
    diffs = run_ranks(sc.train_matches_full_batch, 2, args=("sgd", 3, "none", "cpu", groups))
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_equals_ddp_on_gloo(kind):
    diffs = run_ranks(sc.train_matches_ddp, 2, args=(kind,))
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("compression, tol", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_compressed_gradients_stay_close(compression, tol):
    diffs = run_ranks(sc.train_matches_full_batch, 2, args=("sgd", 5, compression), env=SMALL_BUCKETS)
    assert max(diffs) <= tol, diffs


def test_user_compressor_takes_the_unfused_path():
    diffs = run_ranks(sc.train_matches_full_batch, 2, args=("adam", 3, "custom"), env=SMALL_BUCKETS)
    assert max(diffs) <= 1e-5, diffs


def test_backward_passes_per_step_two():
    diffs = run_ranks(sc.accumulation_matches_full_batch, 2, args=("adam",), env=SMALL_BUCKETS)
    assert max(diffs) <= 1e-5, diffs


def test_no_sync_accumulates_locally():
    diffs = run_ranks(sc.no_sync_matches_full_batch, 2, env=SMALL_BUCKETS)
    assert max(diffs) <= 1e-5, diffs


def test_gradient_clipping_pattern():
    diffs = run_ranks(sc.clipping_pattern, 2, env=SMALL_BUCKETS)
    assert max(diffs) <= 1e-5, diffs


def test_horovod_errors_warning_and_lr_scheduler():
    run_ranks(sc.misuse_errors, 2, env=SMALL_BUCKETS)


def test_frozen_and_dynamically_frozen_parameters():
    results = run_ranks(sc.frozen_parameters, 2, env=SMALL_BUCKETS)
    assert all(r["same_on_all_ranks"] for r in results)


def test_parameter_unused_on_one_rank():
    assert run_ranks(sc.unused_parameter_on_one_rank, 2) == [True, True]


def test_mismatched_models_raise_on_every_rank():
    run_ranks(sc.mismatched_models, 2)


def test_bad_arguments():
    run_ranks(sc.bad_arguments, 1)


def test_broadcast_optimizer_state():
    a, b = run_ranks(sc.broadcast_optimizer_state_scenario, 2)
    assert a == b
    assert a["lr"] == (0.01, 0.01) and a["betas"] == ((0.8, 0.9), (0.8, 0.9))
    assert a["steps"][0] == a["steps"][1] and a["steps"][0] == [2.0] * len(a["steps"][0])
    assert a["moments_equal"]


def test_rank0_checkpoint(tmp_path):
    assert run_ranks(sc.checkpoint_scenario, 2, args=(str(tmp_path),)) == [True, False]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


def test_checkpoint_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    import torch

    from gpucomm.torch.checkpoint import save_checkpoint

    path = tmp_path / "model.pt"
    assert save_checkpoint({"v": 1}, path)
    real_save = torch.save

    def crash(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"v": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
@pytest.mark.parametrize("kind, compression, tol", [("sgd", "none", 1e-5), ("adam", "none", 1e-5), ("sgd", "bf16", 1e-2)])
def test_two_ranks_on_one_gpu_equal_full_batch_training(kind, compression, tol):
    """CUDA path: pack kernel -> NCCL (socket transport, single-GPU test mode) -> unpack kernel."""
    env = dict(SMALL_BUCKETS, GPUCOMM_SINGLE_GPU_TEST="1")
    diffs = run_ranks(sc.train_matches_full_batch, 2, args=(kind, 5, compression, "cuda"), env=env, timeout=600)
    assert max(diffs) <= tol, diffs


@pytest.mark.parametrize("set_to_none", [True, False])
def test_averaging_divides_after_the_sum_as_horovod_does(set_to_none):
    """Horovod's Average: 1/f before the sum, f/size after (f: ``gradient_predivide_factor``). Two
    ranks each send float32's smallest subnormal: divided after the sum it stays, divided before it
    rounds to zero. Both the copied (``set_to_none=True``) and the in-place view paths."""
    expected = sc.TINY
    for f, want in [(1.0, expected), (2.0, 0.0)]:
        steps = run_ranks(sc.averaging_order, 2, args=(f, set_to_none))
        for grads in steps:
            assert grads == [[want] * 5, [want] * 5], (f, grads)


def test_a_parameter_group_added_after_wrapping_is_averaged():
    """Horovod's hooks are fixed when it wraps: a group added later was never averaged and the replicas
    drifted apart silently. Here it joins the layout and is averaged; PowerSGD and Adasum, which cannot
    take it in, refuse it with the fix."""
    for seen in run_ranks(sc.group_added_after_wrapping, 2):
        assert all(step == [[[1.5] * 3], [[1.5] * 3]] for step in seen["grads"]), seen["grads"]
        assert seen["same_weights"], seen
        assert set(seen["refused"]) == {"powersgd", "adasum"}, seen["refused"]
        assert all("Build the optimizer with every group" in text for text in seen["refused"].values()), seen


def test_a_rank_missing_from_a_step_is_explained_to_the_rank_waiting_in_it():
    """A fixed-schedule step is never negotiated, so neither the stall warning nor the deadlock check sees
    a rank that does not reach it: the waiting rank failed with Gloo's bare "Timed out waiting ... for recv
    operation". It now says what the step needs, the likely causes and the fix."""
    errors = run_ranks(sc.one_rank_late_for_a_step, 2, env={"GPUCOMM_TIMEOUT": "2"}, timeout=120)
    assert "DistributedOptimizer.bucket." in errors[0] and "fixed schedule" in errors[0], errors[0]
    assert "hvd.join()" in errors[0] and "GPUCOMM_TIMEOUT (2 s)" in errors[0], errors[0]


def test_a_rank_waiting_long_in_a_step_is_named_by_the_stall_warning():
    """A step is never negotiated, so the stall inspector did not see a rank waiting in one: no warning at
    all until GPUCOMM_TIMEOUT. The waiting rank now tells rank 0, which warns after the stall time."""
    env = {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_TIMEOUT": "60"}
    warnings = run_ranks(sc.step_wait_warned, 2, env=env, timeout=120)
    assert len(warnings[0]) == 1 and "rank 0: a step of DistributedOptimizer schedule" in warnings[0][0], warnings
    assert "hvd.join()" in warnings[0][0], warnings[0]


@pytest.mark.parametrize("leaver", [1, 0])
def test_a_rank_that_ran_fewer_steps_and_shut_down_is_named_by_the_ranks_still_stepping(leaver):
    """A rank that finished its batches first and shut gpucomm down (uneven data without hvd.join()) left
    the others with Gloo's "Connection reset by peer" after a 2 s wait for a cause (a clean exit names
    none), or, where no reset comes (MPI, NCCL), waiting for GPUCOMM_TIMEOUT. Rank 0 now tells every rank
    who left, and a step that needs it fails naming it and the fix. Rank 0 leaving is told too."""
    errors = run_ranks(sc.ran_fewer_steps, 2, args=(leaver,), env={"GPUCOMM_TIMEOUT": "60"}, timeout=120)
    assert errors[leaver] is None, errors
    stepping = errors[1 - leaver]
    assert f"rank {leaver} shut gpucomm down (hvd.shutdown(), or its script ended)" in stepping, stepping
    assert "DistributedOptimizer.bucket." in stepping and "hvd.join()" in stepping, stepping


def test_a_schedules_launches_are_numbered_alike_on_every_rank_whatever_ends_its_steps():
    """A review's finding: numbered per step, a step that a poll flushed on one rank only was counted twice
    there (the flush ended it, synchronize() opened and ended an empty one), so a departed rank's count no
    longer matched and a healthy step could fail as needing it. Launches are numbered one by one now."""
    seen = run_ranks(sc.launches_numbered_alike_when_one_rank_flushes, 2, timeout=120,
                     env={"GPUCOMM_ISSUE_ORDER": "all", "GPUCOMM_INLINE_BYTES": "0"})
    assert seen[0]["stamps"] == seen[1]["stamps"] and seen[0]["record"] == seen[1]["record"], seen
    assert [s[2] for s in seen[0]["stamps"]] == list(range(1, len(seen[0]["stamps"]) + 1)), seen
