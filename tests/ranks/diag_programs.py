"""Programs the diagnostics tests run under gpucomm-run (``python -m tests.ranks.diag_programs NAME``)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import gpucomm.torch as hvd


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _step(model, opt) -> None:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 3, 16, 16)), torch.randint(0, 10, (16,)))
    loss.backward()
    opt.step()


def train() -> None:
    """A few DistributedOptimizer steps and one metric allreduce (the timeline test's job)."""
    hvd.init()
    model, opt = _model_and_optimizer()
    for _ in range(4):
        _step(model, opt)
    hvd.allreduce(torch.tensor([1.0]), name="metric")
    hvd.shutdown()


def die_mid_training() -> None:
    """Rank 1 raises at step 3 while rank 0 trains on: rank 0 must end with rank 1's error."""
    hvd.init()
    model, opt = _model_and_optimizer()
    for step in range(200):
        if hvd.rank() == 1 and step == 3:
            print(json.dumps({"raised_at": time.time()}), flush=True)
            raise ValueError("corrupt batch 3 on rank 1")
        _step(model, opt)
    hvd.shutdown()


def dynamic_timeline() -> None:
    """start_timeline / stop_timeline around some steps; the file is valid JSON after stop."""
    hvd.init()
    path = sys.argv[2]
    hvd.allreduce(torch.ones(3), name="before")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="during")
    hvd.allgather(torch.ones(2, 2), name="gathered")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="after")
    if hvd.rank() == 0:
        with open(path) as f:
            json.load(f)
    hvd.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    globals()[sys.argv[1]]()
