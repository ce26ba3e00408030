"""Sparse gradients and optimizer state, as Horovod has them (issue 19): ``hvd.sparse_allreduce_async``,
``DistributedOptimizer`` on ``nn.Embedding(sparse=True)`` with and without ``sparse_as_dense``, and
``hvd.broadcast_optimizer_state`` when parameters have no gradient or no state yet."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import sparse_scenarios as sc
from tests.harness import run_ranks

TOL = 1e-5  # fp32


@pytest.mark.parametrize("size", [2, 3])
def test_sparse_allreduce_async_equals_the_dense_reduction(size):
    results = run_ranks(sc.sparse_allreduce_cases, size, timeout=120)
    cases = 2 * len(sc.CASES)  # each with Average and Sum; at 3 ranks ranks 0 and 1 also on their pair's set
    assert [r["checked"] for r in results] == [cases * (2 if size > 2 and rank < 2 else 1) for rank in range(size)]
    for r in results:
        max_error, dense_error = r["errors"]
        assert max_error is not None and "hvd.Average or hvd.Sum" in max_error, max_error
        assert dense_error is not None and "sparse" in dense_error, dense_error


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("readiness", ["1", "0"])
def test_sparse_embedding_trains_like_one_process_on_the_full_batch(size, readiness):
    """N ranks on their shards end with the weights of one process on the whole batch, with and
    without sparse_as_dense, with backward_passes_per_step=2 + synchronize()/skip_synchronize(),
    and with a sparse parameter that only some ranks use in some steps (nothing hangs).
    ``readiness``: whether the CPU buckets are cut again after the first step (the sparse
    parameters are then agreed with that new layout; without it, on their own, as on GPU)."""
    env = {"GPUCOMM_FUSION_BY_READINESS": readiness}
    for rank, seen in enumerate(run_ranks(sc.sparse_training, size, timeout=180, env=env)):
        for label in ("sparse", "dense", "sparse_passes"):
            assert seen[label]["diff"] <= TOL, (rank, label, seen[label]["diff"])
            assert seen[label]["guard"] and all(seen[label]["guard"]), (rank, label, seen[label]["guard"])
        # without sparse_as_dense the embeddings leave the buckets after the first step; gradients
        # reach the optimizer sparse on every rank (also where a rank did not use the embedding)
        for label in ("sparse", "sparse_passes"):
            assert seen[label]["in_buckets"] == (False, False, True), (rank, label, seen[label])
            assert set(seen[label]["grad_sparse"]) == {(True, True, False)}, (rank, label, seen[label])
        # sparse_as_dense: averaged densely in the buckets, handed back sparse as they came (Horovod)
        assert seen["dense"]["in_buckets"] == (True, True, True), (rank, seen["dense"])
        assert {(e, h) for e, _, h in seen["dense"]["grad_sparse"]} == {(True, False)}, (rank, seen["dense"])
        adam = seen["sparse_adam"]
        for sparse_as_dense in (False, True):
            assert adam[sparse_as_dense]["diff"] <= TOL, (rank, sparse_as_dense, adam)
            assert adam[sparse_as_dense]["guards"] == [True] * 3, (rank, sparse_as_dense, adam)
        assert adam[False]["buckets"] == 0 and adam[True]["buckets"] == 1, (rank, adam)


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_optimizer_state_with_missing_gradients_and_state(size):
    results = run_ranks(sc.optimizer_state_cases, size, timeout=120)
    assert all(r == results[0] for r in results)
    found = results[0]
    # root's partial state wins everywhere, hyper-parameters included; `unused` (params 4, 5) has none
    assert found["partial"] == {"lr": 0.01, "betas": (0.8, 0.9), "with_state": [0, 1, 2, 3], "steps": [2.0]}
    # a fresh optimizer's state is materialised (Horovod: one step of the wrapped optimizer on zero
    # gradients), for every parameter that requires grad, then a distributed step counts on from it
    assert found["fresh"] == {"with_state": [0, 1, 2, 3, 4, 5], "steps": [1.0], "zero_moments": True, "trained": 2.0}
    assert found["sparse_adam"] == [0]
    assert found["sgd_sparse_buffer"] == [True, False, False]  # embedding; linear weight and bias


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
def test_sparse_allreduce_async_on_cuda():
    seen = run_ranks(sc.sparse_allreduce_cuda, 2, env={"GPUCOMM_SINGLE_GPU_TEST": "1"}, timeout=600)
    assert seen == [True, True]
