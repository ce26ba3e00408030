"""Rank functions for tests/test_sync_batch_norm.py (module level, so the rank pool can import them).

Every rank builds the same full batches from fixed seeds (``batch``) and keeps its shard; the test
process rebuilds them with the same helpers and runs one plain ``torch.nn.BatchNorm*d`` on the
concatenation as the reference. Each rank's loss is ``sum(y_shard * r_shard)`` with ``r`` a fixed
random tensor, so the ranks' losses add up to the full-batch loss ``sum(y * r)``: the input
gradient of a shard equals the reference's slice, and the per-rank weight/bias gradients add up
to the reference's.
"""

from __future__ import annotations

import torch

import gpucomm.torch as hvd

# name, BatchNorm*d, channels, spatial shape, momentum, affine, module dtype, input dtype
CASES = [
    ("1d-flat", 1, 3, (), 0.1, True, torch.float32, torch.float32),
    ("1d-seq", 1, 2, (4,), 0.3, True, torch.float32, torch.float32),
    ("2d-cumulative-fp64", 2, 3, (3, 2), None, True, torch.float64, torch.float64),
    ("3d-no-affine", 3, 2, (2, 2, 2), 0.1, False, torch.float32, torch.float32),
    ("2d-bf16-input", 2, 3, (2, 2), 0.1, True, torch.float32, torch.bfloat16),
    ("1d-fp16-input", 1, 4, (), 0.1, True, torch.float32, torch.float16),
]

# rows per rank for step 0, step 1 and the eval batch: uneven, and a rank with none
SHARDS = {
    1: ([5], [4], [3]),
    2: ([3, 5], [6, 0], [0, 4]),
    3: ([2, 0, 5], [1, 4, 3], [3, 0, 2]),
}


def batch(case: tuple, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch ``x`` (float64, mean far from 0) and the loss weights ``r`` of one step."""
    _, _, channels, spatial, *_ = case
    g = torch.Generator().manual_seed(1000 * step + 17 * channels + len(spatial))
    x = torch.randn(rows, channels, *spatial, generator=g, dtype=torch.float64) * 2.0 + 5.0
    r = torch.randn(rows, channels, *spatial, generator=g, dtype=torch.float64)
    return x, r


def params(case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-trivial affine parameters (float64), so a mix-up of weight and bias shows."""
    channels = case[2]
    g = torch.Generator().manual_seed(7 + channels)
    return torch.rand(channels, generator=g, dtype=torch.float64) + 0.5, torch.randn(channels, generator=g,
                                                                                      dtype=torch.float64)


def torch_runs(case: tuple, device: str) -> bool:
    """Whether this torch's own BatchNorm runs the case's dtypes on ``device`` (torch 2.1 has no CPU kernel for
    float16 input): a case that plain torch cannot run is left out, and the test says which."""
    *_, mdtype, xdtype = case
    try:
        torch.nn.BatchNorm1d(1).to(device=device, dtype=mdtype)(torch.ones(2, 1, device=device, dtype=xdtype))
    except RuntimeError:
        return False
    return True


def shard(t: torch.Tensor, counts: list[int], index: int) -> torch.Tensor:
    start = sum(counts[:index])
    return t[start:start + counts[index]]


def run_case(case: tuple, shards: tuple, index: int, device: str, process_set=None) -> dict:
    """Two training steps and one eval batch of SyncBatchNorm on this rank's shards."""
    _, _, channels, _, momentum, affine, mdtype, xdtype = case
    kwargs = {} if process_set is None else {"process_set": process_set}
    bn = hvd.SyncBatchNorm(channels, momentum=momentum, affine=affine, **kwargs).to(device=device, dtype=mdtype)
    if affine:
        w, b = params(case)
        with torch.no_grad():
            bn.weight.copy_(w)
            bn.bias.copy_(b)
    out: dict = {"steps": []}
    for step in range(2):
        counts = shards[step]
        x, r = batch(case, step, sum(counts))
        xs = shard(x, counts, index).to(device=device, dtype=xdtype).requires_grad_()
        rs = shard(r, counts, index).to(device=device, dtype=xdtype)
        y = bn(xs)
        (y * rs).sum().backward()
        rec = {"y": y.detach().cpu(), "dx": xs.grad.cpu(), "dtype": y.dtype}
        if affine:
            rec["dw"], rec["db"] = bn.weight.grad.cpu().clone(), bn.bias.grad.cpu().clone()
            bn.weight.grad = bn.bias.grad = None
        out["steps"].append(rec)
    out["running_mean"] = bn.running_mean.cpu()
    out["running_var"] = bn.running_var.cpu()
    out["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    counts = shards[2]
    x, _ = batch(case, 2, sum(counts))
    with torch.no_grad():
        out["eval"] = bn(shard(x, counts, index).to(device=device, dtype=xdtype)).cpu()
    return out


def model(norm: type) -> torch.nn.Module:
    """A small net with a batch norm in the middle (the same initial weights for any ``norm``)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), norm(6), torch.nn.ReLU(), torch.nn.Linear(6, 1))


def regression(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(rows, 4, generator=g) + 1.0
    return x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(rows, 1, generator=g)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, shards: tuple, index: int, scale: int,
          device: str) -> dict:
    """Three SGD steps on this rank's shards of the loss ``sum of squared errors / global rows``,
    times ``scale`` (the number of ranks, which the optimizer's Average divides back out)."""
    for step in range(3):
        counts = shards[step % 2]
        x, y = regression(step, sum(counts))
        out = net(shard(x, counts, index).to(device))
        loss = ((out - shard(y, counts, index).to(device)) ** 2).sum() * scale / sum(counts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def matches_full_batch(device: str = "cpu", case_names: list[str] | None = None) -> dict:
    """Every case on this rank's shards; at 3 ranks also one case on the process set {0, 2}; a model
    with a SyncBatchNorm trained by DistributedOptimizer; and a global batch of one row, which
    every rank must refuse alike (no rank left waiting)."""
    import os

    size = int(os.environ["GPUCOMM_SIZE"])
    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[pair] if size == 3 else None)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    rank = hvd.rank()
    cases = [c for c in CASES if case_names is None or c[0] in case_names]
    results = {"cases": {c[0]: run_case(c, SHARDS[size], rank, device) for c in cases if torch_runs(c, device)},
               "left_out": [c[0] for c in cases if not torch_runs(c, device)]}
    if size == 3 and rank in pair.ranks:
        results["pair"] = run_case(CASES[1], ([4, 1], [0, 3], [2, 2]), pair.rank(), device, process_set=pair)
    net = model(hvd.SyncBatchNorm).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2),
                                   named_parameters=net.named_parameters())
    results["trained"] = train(net, opt, SHARDS[size], rank, size, device)
    bn = hvd.SyncBatchNorm(2).to(device)
    try:
        bn(torch.ones(1 if rank == 0 else 0, 2, device=device))
        results["one_row_error"] = None
    except ValueError as e:
        results["one_row_error"] = str(e)
    hvd.barrier()
    hvd.shutdown()
    return results
