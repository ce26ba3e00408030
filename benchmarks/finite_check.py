"""What the finite check (``DistributedOptimizer(check_finite=...)``) costs per training step, beside
the same step without it, in the same job.

Two DistributedOptimizers wrap identical copies of one model, one with the check (``--mode``: the
default ``auto``, or ``warn``/``raise``), one with ``check_finite=False``; rounds alternate between them (checked, plain, checked, ...) so machine noise hits
both, and each round's ratio is kept. The counters prove the check ran and sent nothing more.

    gpucomm-run -np 2 python benchmarks/finite_check.py [--model cnn10m] [--json finite_check.json]
    gpucomm-run -np 2 --single-gpu-test python benchmarks/finite_check.py --cuda

Prints the median step time of each, the ratio checked / plain with the spread of the per-round
ratios, and writes JSON. Issue 36: the check is on by default if it costs at most 1 % of a step on CPU
and on GPU.

Where the search costs more than the default mode's budget (``auto``: 0.5 % of the step's time, on
average; a large MLP on CPU, whose sum over 38 MB takes ~5 % of its step), the check searches only
some steps, and the time since its last step counts toward the budget, up to one step's worth: so
the first checked step after the plain block is always searched. Short blocks
(``--steps-per-round 6``) then search one step in six, not the steady state's one in ~11. For such
models give ``--steps-per-round 30``. Measured on 2 cores, mlp10m: +3.2 % with 6 steps per round,
-0.5 % (quartiles -2.2 % to -0.1 %) with 30.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stats import fmt, quartiles, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn10m", choices=["mlp10m", "cnn10m", "cnn", "resnet50", "transformer"])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cuda", action="store_true", help="train on this rank's GPU")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 4, 2 rounds of 2 steps, 1 warm-up")
    ap.add_argument("--mode", default="auto", choices=["auto", "warn", "raise"],
                    help="the checked variant's mode (default auto: the default a DistributedOptimizer gets)")
    ap.add_argument("--json", default="finite_check.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_size, args.rounds, args.steps_per_round, args.warmup = 4, 2, 2, 1
    if min(args.batch_size, args.rounds, args.steps_per_round) < 1 or args.warmup < 0:
        ap.error("batch size, rounds and steps per round must be >= 1, warm-up >= 0")
    return args


def main() -> None:
    args = parse_args()
    hvd.init()
    if args.cuda and not torch.cuda.is_available():
        print("finite_check: --cuda needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    variants = {}
    for name, check in (("checked", args.mode), ("plain", False)):
        model = copy.deepcopy(base).to(device)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                       named_parameters=model.named_parameters(), check_finite=check)
        variants[name] = (model, opt)
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g).to(device)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)

    def step(name: str) -> None:
        model, opt = variants[name]
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def timed(name: str, n: int) -> float:
        hvd.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step(name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    for name in variants:
        timed(name, args.warmup)
    before = hvd.stats()
    seconds = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds[name].append(timed(name, args.steps_per_round))
    after = hvd.stats()
    counts = {k: after[k] - before[k] for k in ("control_rounds", "nonfinite_steps", "schedule_steps", "collectives")}
    # the job's step is its slowest rank's
    every = hvd.allgather_object(seconds)
    job = {name: [max(rank[name][i] for rank in every) for i in range(args.rounds)] for name in variants}
    ratios = [c / p for c, p in zip(job["checked"], job["plain"])]
    result = {
        "model": args.model, "device": str(device), "ranks": hvd.size(), "batch_per_rank": args.batch_size,
        "mode": args.mode,
        "step_s": {name: statistics.median(v) for name, v in job.items()},
        "ratio_checked_vs_plain": statistics.median(ratios), "ratio_quartiles": quartiles(ratios),
        "cost_pct_of_step": 100.0 * (statistics.median(ratios) - 1.0), "counters": counts,
        "rounds": args.rounds, "steps_per_round": args.steps_per_round,
    }
    if hvd.rank() == 0:
        print(f"# finite check cost ({args.mode}): {args.model} on {hvd.size()} rank(s), {device}, batch "
              f"{args.batch_size} per rank, "
              f"{args.rounds} interleaved rounds x {args.steps_per_round} steps")
        for name in variants:
            print(f"  {name:<8} {fmt(result['step_s'][name] * 1e3, '.2f')} ms/step")
        q = result["ratio_quartiles"] or [None, None]
        print(f"  checked / plain: {fmt(result['ratio_checked_vs_plain'], '.4f')} (round quartiles "
              f"{fmt(q[0], '.4f')}-{fmt(q[1], '.4f')}): {fmt(result['cost_pct_of_step'], '+.2f')}% of the step")
        print(f"  counters over the timed rounds: {counts} (the check adds no collective and no control round)")
        write_json(args.json, result)
        print(f"# wrote {args.json}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
