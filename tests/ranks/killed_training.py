"""A few training steps in which one rank SIGKILLs itself: the rank programs that test how a job ends
when a rank dies in the middle of training (``dead_store_program.py``, ``mpi_surface_program.py``)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import gpucomm.torch as hvd

STEPS = 200


def train_until_killed(victim: int, kill_step: int) -> None:
    """Train a small model; rank ``victim`` prints ``KILLED_AT <wall time>`` and SIGKILLs itself at
    ``kill_step`` (the time lets a test print how long the job took to end; never asserted on)."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    for step in range(STEPS):
        if hvd.rank() == victim and step == kill_step:
            print(f"KILLED_AT {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.02)
    hvd.shutdown()
