"""Rank-side body of ``tests/test_optimizer_state.py``: what ``hvd.broadcast_optimizer_state``
leaves in ``p.grad``, as Horovod leaves it."""

from __future__ import annotations

import torch
import torch.nn as nn

import gpucomm.torch as hvd


def gradients_after_broadcast() -> dict:
    """(a) Every rank fresh: each parameter that requires grad and had no gradient ends with a zero
    gradient (Horovod's state creation sets them and never clears them); a gradient rank 1 holds is
    kept; a frozen parameter keeps None. (b) Root has state, rank 1 has none: only rank 1 gets zeros."""
    hvd.init()
    r, out = hvd.rank(), {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    if r == 1:
        model[1].weight.grad = torch.full_like(model[1].weight, 3.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    out["fresh"] = {n: None if g is None else float(g.abs().sum()) for n, g in grads.items()}
    out["norm_works"] = float(sum(g.norm() for g in grads.values() if g is not None)) >= 0  # a script reading p.grad
    opt.zero_grad()
    model(torch.ones(5, 3)).sum().backward()
    opt.step()  # training goes on from there
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r == 0:  # root creates its state by stepping; rank 1 has none
        model(torch.ones(5, 3)).sum().backward()
        plain.step()
    for p in model.parameters():
        p.grad = None
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    out["root_had_state"] = [p.grad is not None for p in model.parameters()]
    hvd.shutdown()
    return out
