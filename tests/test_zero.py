"""ZeRO-1 (``hvd.ZeroRedundancyOptimizer``) at 2, 3 and 4 CPU ranks: equal to DistributedOptimizer
with the same optimizer (uneven shards, parameters straddling ranks, param groups, a layer frozen
midway, accumulation, model= overlap), identical on every rank, 1/N of the optimizer state per rank,
no control message in steady state, torch's consolidation, a checkpoint saved at 4 ranks resumed
at 2, hvd.join, TorchState and broadcast_optimizer_state. Memory and speed at scale are a benchmark
(benchmarks/compression_memory.py)."""

from __future__ import annotations

import pytest
import torch

import gpucomm.torch as hvd
from tests.harness import run_ranks
from tests.ranks import zero_scenarios as sc

SMALL_BUCKETS = {"GPUCOMM_FUSION_THRESHOLD": "256", "GPUCOMM_FUSION_FIRST_BUCKET": "128"}  # several buckets


@pytest.mark.parametrize("size", [2, 3, 4])
def test_equals_distributed_optimizer_with_one_nth_of_the_state(size):
    results = run_ranks(sc.equals_distributed_optimizer, size, env=SMALL_BUCKETS, timeout=120)
    total = 0
    for rank, out in enumerate(results):
        assert max(out["params"].values()) <= 1e-6 and max(out["after_freeze"].values()) <= 1e-6, out
        assert out["passes"] <= 1e-6 and out["state"] <= 1e-6, out
        assert out["identical"] and out["control_rounds"] == 0, out
        assert out["loads_into_plain"], out
        assert out["consolidated"] is True if rank else out["consolidated"] <= 1e-6, out
        mine, full = out["state_bytes"]
        assert mine <= full / size + 64, (rank, mine, full)  # a part of the largest shard's rounding at most
        total += mine
    assert total == results[0]["state_bytes"][1]  # the shards hold the whole state, once


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
def test_equals_distributed_optimizer_on_cuda():
    """Reduce-scatter and allgather on NCCL (single-GPU test mode), the shards on the GPU."""
    env = dict(SMALL_BUCKETS, GPUCOMM_SINGLE_GPU_TEST="1")
    for out in run_ranks(sc.equals_distributed_optimizer, 2, args=("cuda",), env=env, timeout=600):
        assert max(out["params"].values()) <= 1e-5 and max(out["after_freeze"].values()) <= 1e-5, out
        assert out["passes"] <= 1e-5 and out["state"] <= 1e-5 and out["identical"], out


def test_checkpoint_saved_at_four_ranks_resumes_at_two(tmp_path):
    assert run_ranks(sc.checkpoint, 4, args=(str(tmp_path), "save"), timeout=120) == [True, False, False, False]
    resumed = run_ranks(sc.checkpoint, 2, args=(str(tmp_path), "resume"))
    reference = sc.single_process_reference()
    for seen in resumed:
        for got, want in zip(seen, reference[3:]):
            assert torch.allclose(got, want, rtol=0, atol=1e-6), float((got - want).abs().max())


def test_join_elastic_state_broadcast_and_clipping():
    for out in run_ranks(sc.join_elastic_and_broadcast, 2):
        assert out["lr"] == 0.01 and out["last"] == 0 and out["identical_after_join"], out
        assert out["restored_params"] and out["replay_equal"] and out["bytes"] > 0, out
        assert out["clip_active"] and out["clip_norms"] <= 1e-6 and out["clipped"] <= 1e-6, out


def test_refuses_what_it_cannot_shard():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="elementwise"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), "adam", lr=0.1)


@pytest.mark.parametrize("what", ["class", "lr", "params"])
def test_ranks_that_build_it_differently_are_refused_on_every_rank_naming_it(what):
    """Issue 36, finding 5: SGD on one rank and Adam on another, or another learning rate, trained each
    shard differently without a word; a parameter mismatch was reported as DistributedOptimizer's."""
    for message in run_ranks(sc.disagreeing_ranks, 2, args=(what,)):
        assert message.startswith("ZeroRedundancyOptimizer: ranks disagree on the "), message
        if what == "class":  # refused at construction
            assert "optimizer class" in message and "Adam" in message and "SGD" in message, message
        elif what == "lr":  # refused at the first step (Horovod broadcasts rank 0's options before it)
            assert "options at the first step" in message and "lr=0.2" in message, message
            assert "broadcast_optimizer_state" in message, message


def test_an_optimizer_whose_step_needs_a_closure_is_refused_with_why():
    """Issue 36, finding 5: LBFGS marked elementwise=True failed at step() with a TypeError."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="LBFGS.step needs a closure"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=0.1, elementwise=True)
