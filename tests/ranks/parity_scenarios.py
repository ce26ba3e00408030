"""Rank functions for tests/test_horovod_parity.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import torch

import gpucomm.torch as hvd


def homogeneous_and_set_barriers() -> dict:
    """``is_homogeneous`` on one host, and barriers on a non-global process set (static and dynamic)."""
    first_two = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[first_two] if hvd_size_hint() > 2 else None)
    homogeneous = hvd.is_homogeneous()
    ps = first_two if hvd.size() > 2 else hvd.global_process_set
    if hvd.rank() in ps.ranks:
        hvd.barrier(process_set=ps)
        hvd.allreduce(torch.ones(1), process_set=ps)  # unnamed, members only: must not shift the global numbering
    hvd.barrier()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # unnamed, every rank
    hvd.shutdown()
    return {"homogeneous": homogeneous, "total": total}


def hvd_size_hint() -> int:
    import os

    return int(os.environ["GPUCOMM_SIZE"])


def grouped_allgather_gradients() -> dict:
    """``grouped_allgather`` tracks gradients, and each equals the per-tensor ``allgather``'s."""
    hvd.init()
    rank = hvd.rank()
    rows = [rank + 1, 2]  # dim 0 differs per rank for the first tensor
    grouped_inputs = [torch.full((n, 3), float(rank + 1 + i), requires_grad=True) for i, n in enumerate(rows)]
    single_inputs = [t.detach().clone().requires_grad_(True) for t in grouped_inputs]
    weights = [torch.arange(1.0, 1.0 + 3 * sum(range(2, hvd.size() + 2)) + 3 * 2 * hvd.size())]
    grouped = hvd.grouped_allgather(grouped_inputs, name="grouped")
    single = [hvd.allgather(t, name=f"single.{i}") for i, t in enumerate(single_inputs)]
    has_grad_fn = [o.grad_fn is not None for o in grouped]

    def loss(outs):  # rank-dependent weights, so the Average over ranks matters
        flat = torch.cat([o.reshape(-1) for o in outs])
        return (flat * weights[0][: flat.numel()] * (rank + 1)).sum()

    loss(grouped).backward()
    loss(single).backward()
    hvd.shutdown()
    return {"has_grad_fn": has_grad_fn, "grouped": [t.grad.tolist() for t in grouped_inputs],
            "single": [t.grad.tolist() for t in single_inputs], "shapes": [list(t.grad.shape) for t in grouped_inputs]}


def optimizer_on_non_members() -> dict:
    """``DistributedOptimizer(process_set=ps)`` on a rank outside ``ps``: no hooks, ``step()`` is a
    plain local step (Horovod); members average over ``ps`` only."""
    first_two = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[first_two] if hvd_size_hint() > 2 else None)
    first_two = first_two if hvd.size() > 2 else hvd.global_process_set
    rank = hvd.rank()
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=first_two)
    for _ in range(2):
        opt.zero_grad()
        model(torch.full((1, 2), float(rank + 1))).sum().backward()
        opt.step()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()  # a third, local step with the gradients of the second: same on every rank of a set
    hvd.barrier()
    hvd.shutdown()
    return {"weight": model.weight.detach().tolist()[0]}


def optimizer_guards() -> dict:
    """Horovod's guards: ``zero_grad()`` after any gradient hook fired (even one that only
    accumulated locally) raises; ``step()`` after ``synchronize()`` warns with Horovod's text."""
    import warnings

    from gpucomm.torch.parameters import STEP_AFTER_SYNC_WARNING, ZERO_GRAD_ERROR

    hvd.init()
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    out = {}
    model(torch.ones(2, 3)).sum().backward()  # first of two passes: nothing is launched yet
    try:
        opt.zero_grad()
        out["zero_grad"] = "allowed"
    except AssertionError as e:
        out["zero_grad"] = str(e) == ZERO_GRAD_ERROR
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warning"] = [str(w.message) == STEP_AFTER_SYNC_WARNING for w in caught]
    opt.zero_grad()  # after step: allowed
    hvd.shutdown()
    return out


def horovod_autograd_classes() -> dict:
    """Horovod's eight autograd classes called with Horovod's own ``apply`` arguments (2 ranks)."""
    from gpucomm.torch import mpi_ops as m

    hvd.init()
    rank, ps = hvd.rank(), hvd.global_process_set
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    summed = m.HorovodAllreduce.apply(x, None, "ac.allreduce", hvd.Sum, 1.0, 1.0, ps)
    summed.sum().backward()
    grouped = m.HorovodGroupedAllreduce.apply(None, "ac.grouped", hvd.Average, 1.0, 2.0, ps,
                                              torch.tensor([0.5 + rank]), torch.tensor([1.0 + rank]))
    gathered = m.HorovodAllgather.apply(torch.tensor([float(rank)]), "ac.allgather", ps)
    m.HorovodGroupedAllgather.apply("ac.grouped_allgather", ps, torch.tensor([float(rank)]))
    broadcast = m.HorovodBroadcast.apply(torch.tensor([float(rank)]), 0, "ac.broadcast", ps)
    _, splits = m.HorovodAlltoall.apply(torch.tensor([1.0, 2.0]), torch.tensor([1, 1]), "ac.alltoall", ps)
    scattered = m.HorovodReducescatter.apply(torch.ones(2), "ac.reducescatter", hvd.Sum, ps, 1.0, 1.0)
    m.HorovodGroupedReducescatter.apply("ac.grouped_rs", hvd.Sum, ps, 1.0, 1.0, torch.ones(2))
    out = {"rank": rank, "allreduce": summed.tolist(), "allreduce_grad": x.grad.tolist(),
           "grouped": [t.tolist() for t in grouped], "allgather": gathered.tolist(), "broadcast": broadcast.tolist(),
           "reducescatter": scattered.tolist(), "alltoall_splits": splits.tolist()}
    hvd.shutdown()
    return out
