"""An elastic job for tests/test_netfaults.py and tests/test_multihost.py: a small regression
trained for ``PARTITION_STEPS`` steps inside ``hvd.elastic.run``, committed after every step, while
hosts are cut off, added or removed around it.

Rank 0 prints ``step S size N`` after every step (the tests act on it) and, at the end, writes
``PARTITION_OUT/result.json``: the job's size at every step, how many times it was reset, and the
trained weights. Every worker prints ``reset at T`` when the job re-forms (T: ``time.time()``), and writes its threads'
stacks to ``PARTITION_OUT/stacks.<pid>.txt`` on SIGUSR1 (where a worker that did not end waits).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path

import torch

import gpucomm.torch as hvd

STEPS = int(os.environ.get("PARTITION_STEPS", "40"))
PAUSE = float(os.environ.get("PARTITION_SLEEP", "0.2"))
FEATURES = 4


def main() -> None:
    if os.environ.get("PARTITION_OUT"):
        stacks = open(Path(os.environ["PARTITION_OUT"]) / f"stacks.{os.getpid()}.txt", "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, sizes=[])
    resets = []

    def on_reset() -> None:
        resets.append(time.time())
        print(f"reset at {time.time():.3f}: rank {hvd.rank()} of {hvd.size()}", flush=True)

    state.register_reset_callbacks([on_reset])
    x = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)

    @hvd.elastic.run
    def train(state) -> None:
        while state.step < STEPS:
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            optimizer.step()
            state.step += 1
            state.sizes = state.sizes + [hvd.size()]
            if hvd.rank() == 0:
                print(f"step {state.step} size {hvd.size()}", flush=True)
            time.sleep(PAUSE)
            state.commit()

    train(state)
    if hvd.rank() == 0 and os.environ.get("PARTITION_OUT"):
        result = {"sizes": state.sizes, "resets": len(resets), "weight": model.weight.detach().view(-1).tolist()}
        (Path(os.environ["PARTITION_OUT"]) / "result.json").write_text(json.dumps(result))
    hvd.shutdown()


if __name__ == "__main__":
    main()
