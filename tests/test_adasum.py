"""``op=hvd.Adasum`` with Horovod's semantics (issue 19, deliverable 3): the allreduce forms against
a NumPy reference, power-of-two sizes only, the global process set only, and the delta optimizer
against a single-process reference. Horovod's Adasum needs a power-of-two number of ranks, so the
math runs at 2 and 4 ranks and the refusal at 3."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import adasum_scenarios as scenarios
from tests.harness import run_ranks

try:
    from cupy.cuda import nccl
except Exception:  # noqa: BLE001 - no CuPy, or CuPy without NCCL
    nccl = None

HAS_GPU = torch.cuda.is_available() and nccl is not None


def _check_allreduce_results(results: list, size: int) -> None:
    for rank, r in enumerate(results):
        errors = r["errors"]
        assert errors["int"][0] == "ValueError" and "floating" in errors["int"][1], (rank, errors["int"])
        # Horovod raises RuntimeError for reducescatter with Adasum; NotImplementedError is one
        assert errors["reducescatter"][0] == "NotImplementedError", (rank, errors["reducescatter"])
        assert "reducescatter" in errors["reducescatter"][1]
        for what in ("process_set", "optimizer_process_set"):
            assert errors[what] == ("NotImplementedError", "Adasum does not support non-global process sets yet."), \
                (rank, what, errors[what])
        assert r["total"] == float(size)


@pytest.mark.parametrize("size", [2, 4])
def test_allreduce_forms_match_numpy_adasum(size):
    results = run_ranks(scenarios.allreduce_forms, size, args=(11,), timeout=180)
    _check_allreduce_results(results, size)


def test_non_power_of_two_sizes_are_refused_at_3_ranks():
    results = run_ranks(scenarios.non_power_of_two, 3, timeout=120)
    for rank, r in enumerate(results):
        for what, error in r["errors"].items():
            assert error is not None, (rank, what)
            assert error[0] == "NotImplementedError", (rank, what, error)
            assert error[1].startswith("Running Adasum with non-power of 2 ranks is not supported yet."), error
            assert "3 ranks" in error[1], error
        assert r["total"] == 3.0


@pytest.mark.parametrize("size", [2, 4])
def test_delta_optimizer_matches_single_process_reference(size):
    results = run_ranks(scenarios.delta_optimizer, size, args=(5,), timeout=240)
    for rank, r in enumerate(results):
        assert r["isinstance"], rank
        assert r["weights1"] == results[0]["weights1"] and r["weights2"] == results[0]["weights2"], rank
        guards = r["guards"]
        assert guards["zero_grad"][0] == "AssertionError" and "zero_grad" in guards["zero_grad"][1], guards
        assert guards["twice"][0] == "AssertionError" and "backward_passes_per_step" in guards["twice"][1], guards
        assert guards["skip_synchronize"] == (
            "AssertionError", "Skipping synchronization is not supported when using Adasum optimizer."), guards


def test_single_rank_adasum_optimizer_is_the_local_step():
    assert run_ranks(scenarios.single_rank_optimizer, 1, timeout=120)[0] == [0.0] * 5


def test_numpy_reference_follows_horovods_pairing():
    """The reference itself: Adasum is not associative, so the tree's shape matters; level 1 pairs
    ranks (0,1) and (2,3), level 2 combines those two results."""
    import numpy as np

    xs = [np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 2.0]), np.array([3.0, 1.0])]
    pair = scenarios.numpy_adasum
    assert np.allclose(pair(xs), pair([pair(xs[:2]), pair(xs[2:])]))
    assert not np.allclose(pair(xs), pair([pair([xs[0], xs[2]]), pair([xs[1], xs[3]])]))
    a, b = xs[0], xs[1]  # dot 1, |a|^2 1, |b|^2 2: (1 - 1/2) a + (1 - 1/4) b
    assert np.allclose(pair([a, b]), 0.5 * a + 0.75 * b)
    assert np.allclose(pair([np.zeros(2), b]), b)  # a zero side: plain sum


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU, CUDA torch and CuPy's NCCL")
def test_allreduce_forms_on_cuda():
    results = run_ranks(scenarios.allreduce_forms, 2, args=(13, "cuda"), env={"GPUCOMM_SINGLE_GPU_TEST": "1"},
                        timeout=300)
    _check_allreduce_results(results, 2)
