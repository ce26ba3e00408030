"""The GPU data plane on a GPU (issue 25): what only CUDA can show. Skipped cleanly without one;
``pytest -m gpu`` runs them. Two ranks share one GPU through the single-GPU test mode unless a test
needs a GPU per rank."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import data_plane_scenarios as sc
from tests.harness import run_ranks

try:
    from cupy.cuda import nccl
except Exception:  # noqa: BLE001 - CuPy missing or without CUDA pieces
    nccl = None

HAS_GPU = torch.cuda.is_available() and nccl is not None and getattr(nccl, "available", False)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SINGLE = {"GPUCOMM_SINGLE_GPU_TEST": "1"}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU, CUDA torch and CuPy's NCCL")]


def test_kernels_are_compiled_when_the_optimizer_is_built():
    for seen in run_ranks(sc.kernels_compiled_when_built, 2, env=SINGLE, timeout=600):
        assert seen["built"], seen  # compiled before any backward
        assert seen["after_step"] == seen["built"], seen  # the first step compiled nothing more


def test_done_events_are_pooled_across_steps():
    for seen in run_ranks(sc.events_per_step, 2, env=SINGLE, timeout=600):
        assert seen["collectives"] > 0, seen
        assert seen["created"] == 0, seen  # steady state: every event came from the pool
        assert seen["retired"] > 0, seen


def test_channels_last_cuda_gradients_take_no_extra_copy():
    contiguous = run_ranks(sc.copies_per_step, 2, args=(False, "cuda"), env=SINGLE, timeout=600)
    channels_last = run_ranks(sc.copies_per_step, 2, args=(True, "cuda"), env=SINGLE, timeout=600)
    for a, b in zip(contiguous, channels_last):
        assert b["layout_kept"], b
        assert b["copying"] == a["copying"], (a["copying"], b["copying"])


@pytest.mark.parametrize("size", [2, 3])
def test_one_issue_order_on_every_rank_with_nccl(size):
    results = run_ranks(sc.issue_sequence, size, args=(size - 1, "cuda"), env=SINGLE, timeout=600)
    reference = results[0]["issued"]
    for rank, seen in enumerate(results):
        assert seen["issued"] == reference, (rank, seen["issued"], reference)
        assert seen["same"], rank


@pytest.mark.parametrize("size, env", [(2, {}), (1, {"GPUCOMM_ONE_RANK_REDUCER": "1"})],
                         ids=["2-ranks", "1-rank-reducer"])
def test_a_steady_training_step_makes_no_synchronizing_cuda_call(size, env):
    """A step queues its work and returns: a host wait inside it (a ``.item()``, a pageable copy, a stream
    synchronize) would drain the GPU's queue every step (issue 35: the reducer's host time)."""
    small = {"GPUCOMM_FUSION_THRESHOLD": "65536", "GPUCOMM_FUSION_FIRST_BUCKET": "16384"}
    for rank, seen in enumerate(run_ranks(sc.syncs_in_steady_steps, size, env={**SINGLE, **small, **env},
                                          timeout=600)):
        assert seen["buckets"] > 1 and seen["collectives"] >= 3 * seen["buckets"], (rank, seen)
        assert seen["control"] == 1, (rank, seen)  # the recorder saw the one sync the scenario made on purpose
        assert seen["ours"] == [], (rank, seen["lines"], seen["ours"][:3])


def test_a_failed_cuda_job_aborts_its_communicators():
    for rank, seen in enumerate(run_ranks(sc.cuda_job_failure, 2, env=SINGLE, timeout=600)):
        assert "rank 1 fails on purpose" in seen["error"], (rank, seen)
        assert seen["aborts"] >= 1 and seen["destroys"] == 0, (rank, seen)
        print(f"rank {rank}: failure seen after {seen['seconds']:.2f} s")


def test_communicator_on_cupys_default_stream():
    assert run_ranks(sc.communicator_on_cupy_default_stream, 2, env=SINGLE, timeout=300) == [[3.0] * 4] * 2


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs: one rank per GPU, to see a context on another rank's GPU")
def test_no_rank_opens_a_context_on_another_ranks_gpu():
    for rank, seen in enumerate(run_ranks(sc.contexts_per_gpu, 2, timeout=600)):
        if not seen["contexts_on"]:
            pytest.skip("NVML lists no process of ours (a PID namespace hides them); cannot check contexts")
        assert seen["contexts_on"] == [seen["bus"]], (rank, seen)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs: rank 0 on the second one")
def test_the_timelines_gpu_timer_sits_on_rank_0s_gpu(tmp_path):
    seen = run_ranks(sc.timeline_gpu_timer_device, 2, args=(str(tmp_path / "timeline.json"),), timeout=600)[0]
    assert seen["mine"] == 1 and seen["timer"] == 1 and seen["anchor"] == 1, seen
