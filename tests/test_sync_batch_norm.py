"""hvd.SyncBatchNorm: N ranks, each on its shard, behave as one torch.nn.BatchNorm*d on the whole batch
(issue 19, deliverable 2)."""

from __future__ import annotations

import pytest
import torch

import gpucomm.torch as hvd
from tests.ranks import sync_batch_norm_scenarios as sc
from tests.harness import run_ranks

TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference(case: tuple, shards: tuple) -> dict:
    """One process, plain torch BatchNorm in float64 on the concatenated batches (inputs first
    rounded to the dtype the ranks see)."""
    _, dim, channels, _, momentum, affine, _, xdtype = case
    bn = getattr(torch.nn, f"BatchNorm{dim}d")(channels, momentum=momentum, affine=affine, dtype=torch.float64)
    if affine:
        w, b = sc.params(case)
        with torch.no_grad():
            bn.weight.copy_(w)
            bn.bias.copy_(b)
    out: dict = {"steps": []}
    for step in range(2):
        x, r = sc.batch(case, step, sum(shards[step]))
        x = x.to(xdtype).double().requires_grad_()
        y = bn(x)
        (y * r.to(xdtype).double()).sum().backward()
        rec = {"y": y.detach(), "dx": x.grad}
        if affine:
            rec["dw"], rec["db"] = bn.weight.grad.clone(), bn.bias.grad.clone()
            bn.weight.grad = bn.bias.grad = None
        out["steps"].append(rec)
    out["running_mean"], out["running_var"] = bn.running_mean, bn.running_var
    out["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    x, _ = sc.batch(case, 2, sum(shards[2]))
    with torch.no_grad():
        out["eval"] = bn(x.to(xdtype).double())
    return out


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def check_ranks(case: tuple, shards: tuple, per_rank: list[dict]) -> None:
    """Each rank's slice of the output and input gradient, the sum of the ranks' weight/bias
    gradients, the running statistics (the same on every rank) and eval outputs match the reference."""
    name, *_, affine, mdtype, xdtype = case
    want = reference(case, shards)
    tol, stat_tol = TOL[xdtype], TOL[mdtype]
    for step in range(2):
        counts = shards[step]
        for i, got in enumerate(per_rank):
            rec = got["steps"][step]
            assert rec["dtype"] == xdtype, f"{name}: output dtype follows the input"
            close(rec["y"], sc.shard(want["steps"][step]["y"], counts, i), tol, f"{name} step {step} rank {i} output")
            close(rec["dx"], sc.shard(want["steps"][step]["dx"], counts, i), tol,
                  f"{name} step {step} rank {i} input grad")
        if affine:
            for key in ("dw", "db"):
                total = sum(got["steps"][step][key].double() for got in per_rank)
                close(total, want["steps"][step][key], stat_tol, f"{name} step {step} summed {key}")
    for i, got in enumerate(per_rank):
        for key in ("running_mean", "running_var"):
            close(got[key], want[key], stat_tol, f"{name} rank {i} {key}")
        assert got["num_batches_tracked"] == want["num_batches_tracked"] == 2
        close(got["eval"], sc.shard(want["eval"], shards[2], i), tol, f"{name} rank {i} eval output")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_ranks_match_one_process_on_the_concatenated_batch(size):
    results = run_ranks(sc.matches_full_batch, size, timeout=180)
    left_out = results[0]["left_out"]  # only what plain torch cannot run here (float16 on CPU before torch 2.2)
    assert all(not sc.torch_runs(case, "cpu") for case in sc.CASES if case[0] in left_out), left_out
    for case in sc.CASES:
        if case[0] not in left_out:
            check_ranks(case, sc.SHARDS[size], [r["cases"][case[0]] for r in results])
    if size == 3:  # SyncBatchNorm(process_set={0, 2}): rank 1 takes no part
        assert "pair" not in results[1]
        check_ranks(sc.CASES[1], ([4, 1], [0, 3], [2, 2]), [results[0]["pair"], results[2]["pair"]])
    net = sc.model(torch.nn.BatchNorm1d)  # DistributedOptimizer on shards == plain SGD on the whole batch
    want = sc.train(net, torch.optim.SGD(net.parameters(), lr=0.2), tuple([sum(c)] for c in sc.SHARDS[size]), 0, 1,
                    "cpu")
    for i, r in enumerate(results):
        for key, value in want.items():
            close(r["trained"][key], value.double(), TOL[torch.float32], f"rank {i} trained {key}")
    for r in results:  # one row in the whole batch: every rank refuses it, none hangs
        assert r["one_row_error"] is not None and "more than 1 value per channel" in r["one_row_error"]


def test_input_is_validated_before_any_communication():
    bn = hvd.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"at least 2D input \(got 1D"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match="expected 3 channels.*got 4"):
        bn(torch.randn(5, 4, 2))


def test_signature_and_module_type_follow_horovod():
    bn = hvd.SyncBatchNorm(4, eps=1e-3, momentum=None, affine=False, track_running_stats=False)
    assert isinstance(bn, torch.nn.modules.batchnorm._BatchNorm)
    assert (bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (4, 1e-3, None, False, False)
    assert bn.weight is None and bn.running_mean is None
    assert sorted(hvd.SyncBatchNorm(4).state_dict()) == sorted(torch.nn.BatchNorm2d(4).state_dict())


def test_convert_sync_batchnorm_swaps_every_batch_norm_and_keeps_its_state():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3, momentum=0.2),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(5, affine=False)))
    with torch.no_grad():
        model[1].weight.uniform_()
        model[1].running_mean.uniform_()
    model[1].num_batches_tracked += 3
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], hvd.SyncBatchNorm) and isinstance(converted[2][0], hvd.SyncBatchNorm)
    assert isinstance(converted[0], torch.nn.Conv2d)
    assert converted[1].momentum == 0.2 and converted[2][0].affine is False and not converted[1].training
    assert isinstance(converted[1].weight, torch.nn.Parameter) and converted[1].weight.requires_grad
    after = converted.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    x = torch.randn(4, 2, 5, 5)
    torch.testing.assert_close(converted[:2](x), torch.nn.functional.batch_norm(
        model[0](x), before["1.running_mean"], before["1.running_var"], before["1.weight"], before["1.bias"],
        False, 0.0, 1e-5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
def test_two_ranks_on_one_gpu_match_one_process():
    """CUDA path (NCCL over the single-GPU test transport), every case of the CPU test."""
    results = run_ranks(sc.matches_full_batch, 2, args=("cuda",), env={"GPUCOMM_SINGLE_GPU_TEST": "1"}, timeout=600)
    for case in sc.CASES:
        check_ranks(case, sc.SHARDS[2], [r["cases"][case[0]] for r in results])
