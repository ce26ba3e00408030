"""Start-up time: from launching an N-rank CPU job to its first completed allreduce.

Compares ``gpucomm-run`` + ``gpucomm.torch.init()`` with ``torchrun --nproc-per-node N`` +
``torch.distributed.init_process_group("gloo")``, and also gpucomm under torchrun. The runs are
interleaved (each repetition runs every launcher once per size) so machine noise hits all of them.

Run: ``python benchmarks/startup.py [--sizes 2 4 8] [--repeats 3] [--json startup.json]``.
Each rank's worker is this file with ``--worker``; rank 0 prints the wall-clock time at which its
first allreduce completed, and the driver subtracts the time it launched the job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "FIRST_ALLREDUCE_DONE_AT"


def worker(mode: str) -> None:
    import torch

    if mode == "gpucomm":
        import gpucomm.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(1), op=hvd.Sum)
        done, rank = time.time(), hvd.rank()
        if rank == 0:
            print(f"{MARK} {done:.6f}", flush=True)
        hvd.shutdown()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        done, rank = time.time(), dist.get_rank()
        if rank == 0:
            print(f"{MARK} {done:.6f}", flush=True)
        dist.destroy_process_group()


def _bin(name: str) -> list[str]:
    exe = Path(sys.executable).with_name(name)
    return [str(exe)] if exe.exists() else [name]


def command(launcher: str, n: int) -> list[str]:
    me = str(Path(__file__).resolve())
    if launcher == "gpucomm-run":
        return [sys.executable, "-m", "gpucomm.runner", "-np", str(n), sys.executable, me, "--worker", "gpucomm"]
    mode = "gpucomm" if launcher == "torchrun+gpucomm" else "torch"
    return _bin("torchrun") + ["--standalone", "--nproc-per-node", str(n), me, "--worker", mode]


def measure(launcher: str, n: int, timeout: float) -> tuple[float, float]:
    """(seconds to the first completed allreduce, seconds until the launcher exited)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.time()
    proc = subprocess.run(command(launcher, n), capture_output=True, text=True, env=env, timeout=timeout)
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} with {n} ranks failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if MARK in line:
            return float(line.split(MARK)[1]) - t0, total
    raise SystemExit(f"{launcher} with {n} ranks printed no {MARK} line:\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["gpucomm", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--launchers", nargs="+", default=["gpucomm-run", "torchrun", "torchrun+gpucomm"],
                    choices=["gpucomm-run", "torchrun", "torchrun+gpucomm"])
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default="startup.json")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    first: dict[tuple[str, int], list[float]] = {}
    total: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for n in args.sizes:
            for launcher in args.launchers:
                f, t = measure(launcher, n, args.timeout)
                first.setdefault((launcher, n), []).append(f)
                total.setdefault((launcher, n), []).append(t)
                print(f"  repeat {rep + 1}/{args.repeats}: {launcher:17s} {n} ranks: first allreduce at {f:6.2f} s, "
                      f"exit at {t:6.2f} s", file=sys.stderr, flush=True)
    cpus = os.cpu_count()
    print(f"\nStart-up to first completed allreduce, CPU, {cpus} cores, median of {args.repeats} (min-max), seconds")
    header = f"{'ranks':>5} | " + " | ".join(f"{name:>22s}" for name in args.launchers)
    print(header)
    print("-" * len(header))
    rows = []
    for n in args.sizes:
        cells = []
        for launcher in args.launchers:
            xs = first[(launcher, n)]
            cells.append(f"{statistics.median(xs):6.2f} ({min(xs):5.2f}-{max(xs):5.2f})")
            rows.append({"launcher": launcher, "ranks": n, "first_allreduce_s": xs, "exit_s": total[(launcher, n)],
                         "median_first_allreduce_s": statistics.median(xs)})
        print(f"{n:>5} | " + " | ".join(f"{c:>22s}" for c in cells))
    with open(args.json, "w") as f:
        json.dump({"benchmark": "startup", "cpus": cpus, "repeats": args.repeats, "results": rows}, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
