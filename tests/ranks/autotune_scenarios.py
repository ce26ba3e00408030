"""Rank functions for tests/test_autotune.py (module level, so the rank pool can import them)."""

from __future__ import annotations

import os

import torch

import gpucomm.torch as hvd


def train_with_autotune(steps: int) -> dict:
    """A small MLP trained with GPUCOMM_AUTOTUNE set: what the trial did, what steady state costs
    after it, and a fingerprint of the weights (equal on every rank if the plans always agreed)."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    x = torch.randn(16, 64) + hvd.rank()
    for step in range(steps):
        if step == steps - 3:
            before = hvd.stats()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    after = hvd.stats()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"stats": after, "steady_control_rounds": after["control_rounds"] - before["control_rounds"],
            "steady_layout_checks": after["layout_checks"] - before["layout_checks"],
            "weights": weights.tolist(), "log": os.environ.get("GPUCOMM_AUTOTUNE_LOG")}
