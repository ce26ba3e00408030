"""Models for ``python -m gpucomm.scaling --model tests.test_scaling_models:tiny`` (tests/test_scaling.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tiny():
    """(model, batch, loss_fn): a 3-layer MLP on 16 random samples."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    return model, x, lambda out: F.cross_entropy(out, y)


def not_a_triple():
    return torch.nn.Linear(2, 2)
