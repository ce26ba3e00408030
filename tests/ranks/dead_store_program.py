"""A rank of a job launched by hand (rank 0 serves the rendezvous store) for tests/test_dead_store.py:
it trains a few steps; rank 0 SIGKILLs itself in the middle of training. The survivors must end
with the cause, not keep retrying the dead store. Each rank prints ``KILLED_AT``/``EXIT_AT`` lines
(wall clock) so the test can print how long they took (never asserted on)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

atexit.register(lambda: print(f"EXIT_AT {time.time():.3f}", file=sys.stderr, flush=True))  # runs after gpucomm's

import torch  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402


def main() -> None:
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    for step in range(200):
        if r == 0 and step == 5:
            print(f"KILLED_AT {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.02)
    hvd.shutdown()


if __name__ == "__main__":
    main()
