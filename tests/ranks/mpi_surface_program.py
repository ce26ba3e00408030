"""A rank of a ``gpucomm-run --mpi`` job for ``tests/test_mpi_surfaces.py``.

``kill V``: three ranks train a small model; rank V SIGKILLs itself at step 5 (it prints
``KILLED_AT <wall time>`` first, so the test can print how long the job took to end; never asserted).
``listen DIR``: the ranks meet, run an allreduce (MPI's data plane is up), print ``READY <rank>`` and
wait until ``DIR/go`` exists, so the test can read the job's listening sockets meanwhile.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import gpucomm.torch as hvd
from tests.ranks.killed_training import train_until_killed

KILL_STEP = 5
WAIT_LIMIT_S = 90.0


def listen(folder: Path) -> None:
    hvd.init()
    total = hvd.allreduce(torch.ones(1000), op=hvd.Sum, name="up")
    assert total[0].item() == hvd.size(), total
    print(f"READY {hvd.rank()} mpi={hvd.mpi_enabled()}", flush=True)
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        train_until_killed(int(sys.argv[2]), KILL_STEP)
    else:
        listen(Path(sys.argv[2]))
