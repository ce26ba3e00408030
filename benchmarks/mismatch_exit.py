"""A job that goes wrong on purpose: rank r allreduces a tensor of shape [r + 1], and nobody catches
the error. The control plane must turn the mismatch into an error on every rank, and the job must
then end (every rank exits non-zero) instead of hanging.

    gpucomm-run -np 2 python benchmarks/mismatch_exit.py

It needs at least 2 ranks (at 1 rank there is nothing to disagree with: it says so on one line and
exits 2). Its own exit status is non-zero by design; ``benchmarks/control_plane.py --mismatch-exit``
launches it, times the exit and writes the summary and JSON.

Each rank prints, on stdout, ``MISMATCH_CALL <wall time> pid=<pid>`` just before the mismatched call, and
``RANK_EXIT <wall time>`` as the very last thing before the interpreter ends (an atexit hook
registered before gpucomm is imported, so it runs after gpucomm's own shutdown hook). Both use
``time.time()``, so ``benchmarks/control_plane.py --mismatch-exit`` can compare them with the wall
time at which the launcher process ended.
"""

from __future__ import annotations

import atexit
import os
import sys
import time


def _say_exit() -> None:
    print(f"RANK_EXIT {time.time():.6f}", flush=True)


atexit.register(_say_exit)  # before gpucomm's own atexit hook: atexit runs hooks last-in, first-out

import torch  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402


def main() -> None:
    hvd.init()
    if hvd.size() < 2:
        print("mismatch_exit.py: needs at least 2 ranks (a shape mismatch needs two); run it with "
              "gpucomm-run -np 2, or time it with python benchmarks/control_plane.py --mismatch-exit", file=sys.stderr)
        hvd.shutdown()
        sys.exit(2)
    hvd.barrier()  # every rank is up: the time below measures the error path only
    tensor = torch.zeros(hvd.rank() + 1)
    print(f"MISMATCH_CALL {time.time():.6f} pid={os.getpid()}", flush=True)
    hvd.allreduce(tensor, name="mismatch_exit", op=hvd.Sum)  # raises on every rank: shapes differ
    print("NOT_REACHED: the mismatched allreduce returned", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
