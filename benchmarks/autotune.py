"""Autotune against a sweep of fixed bucket caps, gpucomm's default plan and PyTorch DDP, in one job.

Every variant trains an identical copy of one model on the same synthetic batches:

* ``cap N``: DistributedOptimizer with fixed buckets of at most N MiB (GPUCOMM_FUSION_THRESHOLD, no
  re-cut: GPUCOMM_FUSION_BY_READINESS=0);
* ``default``: gpucomm's default (25 MiB caps, re-cut once where backward pauses);
* ``autotune``: GPUCOMM_AUTOTUNE=1 (trained until its trial ends before timing starts);
* ``ddp``: DistributedDataParallel on Gloo (25 MiB buckets).

Rounds interleave the variants (rotating their order) so machine noise hits all; the job's step of a
variant is the slowest rank's median. Then the step model explains the conv net's step: a profile of
one rank's forward/backward/update alone, the α-β line the autotuner fitted (its CSV log), and the
predicted parts (forward, backward, communication, exposed, update) of the autotuned plan and of DDP's.

    gpucomm-run -np 2 python benchmarks/autotune.py [--model cnn10m] [--caps 1,2,4,8,16,25,64] [--json F]

``--quick`` is a smoke run. Writes JSON (default autotune.json) on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import os
import statistics
import sys
import tempfile
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
import models  # noqa: E402
from bench_stats import write_json  # noqa: E402
from torch_group import init_torch_group  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402
from gpucomm.tuning import AlphaBeta, optimal_plan, simulate  # noqa: E402
from gpucomm.tuning.measure import profile_model  # noqa: E402
from gpucomm.tuning.policies import capped_buckets  # noqa: E402

FULL = (32, 8, 4)  # batch per rank, rounds, steps per variant per round
QUICK = (4, 2, 2)
MAX_TUNING_STEPS = 400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn10m", choices=["cnn10m", "mlp10m", "cnn", "resnet50"])
    ap.add_argument("--caps", default="1,2,4,8,16,25,64", help="fixed bucket caps to sweep, MiB, comma-separated")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int, help="steps per variant per round")
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 4, 2 rounds of 2 steps, caps 1,25")
    ap.add_argument("--json", default="autotune.json")
    args = ap.parse_args(argv)
    batch, rounds, steps = QUICK if args.quick else FULL
    args.batch_size = args.batch_size or batch
    args.rounds = args.rounds or rounds
    args.steps = args.steps or steps
    args.caps = [float(c) for c in ("1,25" if args.quick and args.caps == ap.get_default("caps") else args.caps).split(",")]
    if min(args.batch_size, args.rounds, args.steps) < 1 or min(args.caps) <= 0:
        ap.error("--batch-size, --rounds, --steps and every cap must be positive")
    return args


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set variables while an optimizer is built (it reads its planning settings then)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_variants(base: torch.nn.Module, caps: list[float], log_path: str, quick: bool) -> dict:
    def gpucomm_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=model.named_parameters())

    variants = {}
    for cap in caps:
        model = copy.deepcopy(base)
        with environment(GPUCOMM_FUSION_THRESHOLD=str(int(cap * 2**20)), GPUCOMM_FUSION_BY_READINESS="0"):
            variants[f"cap {cap:g}"] = (model, gpucomm_opt(model))
    model = copy.deepcopy(base)
    variants["default"] = (model, gpucomm_opt(model))
    model = copy.deepcopy(base)
    tuning = {"GPUCOMM_AUTOTUNE": "1", "GPUCOMM_AUTOTUNE_LOG": log_path}
    if quick:
        tuning.update(GPUCOMM_AUTOTUNE_WARMUP_SAMPLES="1", GPUCOMM_AUTOTUNE_STEPS_PER_SAMPLE="2")
    with environment(**tuning):
        variants["autotune"] = (model, gpucomm_opt(model))
    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    variants["ddp"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    return variants


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // hvd.local_size()))  # the cores this rank may use
    store = init_torch_group("gloo")
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g)
    log_dir = tempfile.mkdtemp(prefix="gpucomm-autotune-")
    log_path = os.path.join(log_dir, "trial.csv")
    variants = build_variants(base, args.caps, hvd.broadcast_object(log_path, 0, name="autotune.log"), args.quick)

    def step(model, opt) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
        return time.perf_counter() - t0

    for name, (model, opt) in variants.items():  # warm-up; autotune trains until its trial is over
        for _ in range(3):
            step(model, opt)
    tuning_steps = 0
    while hvd.stats()["autotune_done"] == 0 and tuning_steps < MAX_TUNING_STEPS:  # ends at one step on every rank
        step(*variants["autotune"])
        tuning_steps += 1
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += [step(*variants[name]) for _ in range(args.steps)]
    mine = {name: statistics.median(t) for name, t in times.items()}
    every = hvd.allgather_object(mine, name="autotune.medians")
    job = {name: max(m[name] for m in every) for name in names}
    trial = list(csv.DictReader(open(log_path))) if hvd.rank() == 0 and os.path.exists(log_path) else []
    explanation = explain(base, data, target, trial, args) if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        report(args, job, trial, explanation, tuning_steps)
    dist.destroy_process_group()
    del store
    hvd.shutdown()


def explain(base: torch.nn.Module, data: torch.Tensor, target: torch.Tensor, trial: list[dict],
            args: argparse.Namespace) -> dict | None:
    """The step model's account of the step: one rank alone (measured) plus the fitted collective."""
    if not trial:
        return None
    chosen = next(r for r in trial if r["chosen"] == "1")
    cost = AlphaBeta(float(chosen["alpha_us"]) * 1e-6, float(chosen["bandwidth_GBps"]) * 1e9)
    prof = profile_model(copy.deepcopy(base), data, lambda out: F.cross_entropy(out, target), steps=5, warmup=2,
                         name=args.model)
    out = {"profile": {"forward_ms": prof.forward_s * 1e3, "backward_ms": prof.backward_s * 1e3,
                       "update_ms": prof.update_s * 1e3, "gradient_MB": sum(prof.sizes) / 1e6},
           "alpha_us": cost.alpha_s * 1e6, "bandwidth_GBps": cost.bandwidth_Bps / 1e9, "plans": {}}
    plans = {"autotune (model's plan, shared processor)":
             [list(b) for b in optimal_plan(prof.ready_s, prof.sizes, cost, processor="shared").buckets],
             "ddp (25 MiB buckets)": capped_buckets(prof.sizes, first_bytes=1 << 20, cap_bytes=25 << 20, rule="ddp")}
    for name, plan in plans.items():
        p = simulate(prof.ready_s, prof.sizes, plan, cost, forward_s=prof.forward_s, backward_s=prof.backward_s,
                     update_s=prof.update_s, processor="shared")
        out["plans"][name] = {"buckets": len(plan), "step_ms": p.step_s * 1e3, "comm_ms": p.comm_s * 1e3,
                              "alpha_part_ms": len(plan) * cost.alpha_s * 1e3,
                              "bytes_part_ms": sum(prof.sizes) / cost.bandwidth_Bps * 1e3,
                              "exposed_ms": p.exposed_s * 1e3, "overlap_ms": p.overlap_s * 1e3}
    return out


def report(args: argparse.Namespace, job: dict, trial: list[dict], explanation: dict | None, tuning_steps: int) -> None:
    caps = {n: s for n, s in job.items() if n.startswith("cap ")}
    best_cap = min(caps, key=caps.get)
    print(f"model {args.model}, batch {args.batch_size} per rank, {hvd.size()} CPU ranks; {args.rounds} interleaved "
          f"rounds of {args.steps} steps per variant; autotune's trial took {tuning_steps} steps; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'variant':12s} {'median step (ms)':>17s} {'vs DDP':>8s} {'vs default':>11s}")
    for name, s in job.items():
        print(f"{name:12s} {s * 1e3:17.2f} {s / job['ddp']:8.3f} {s / job['default']:11.3f}")
    print(f"autotune vs best fixed cap ({best_cap} MiB): {job['autotune'] / caps[best_cap]:.3f}; vs default: "
          f"{job['autotune'] / job['default']:.3f}; vs DDP: {job['autotune'] / job['ddp']:.3f}")
    for row in trial:
        print(f"  trial: {row['candidate']:18s} {row['buckets']:>3s} buckets, measured {row['measured_step_ms']} ms, "
              f"predicted backward+communication {row['predicted_backward_comm_ms']} ms{'  <- kept' if row['chosen'] == '1' else ''}")
    transport = "MPI" if hvd.mpi_enabled() else "Gloo"  # what carried the job's CPU collectives, the fit's included
    if explanation:
        p = explanation["profile"]
        print(f"model of the step (one rank alone: forward {p['forward_ms']:.1f} ms, backward {p['backward_ms']:.1f} "
              f"ms, update {p['update_ms']:.1f} ms; {p['gradient_MB']:.1f} MB of gradients; {transport} fitted "
              f"{explanation['alpha_us']:.0f} us + bytes / {explanation['bandwidth_GBps']:.2f} GB/s):")
        for name, e in explanation["plans"].items():
            print(f"  {name}: {e['buckets']} buckets, step {e['step_ms']:.1f} ms = compute + communication "
                  f"{e['comm_ms']:.1f} ms ({e['alpha_part_ms']:.2f} ms start-up, {e['bytes_part_ms']:.1f} ms bytes), "
                  f"exposed after backward {e['exposed_ms']:.1f} ms")
    write_json(args.json, {"benchmark": "autotune", "model": args.model, "ranks": hvd.size(),
                           "batch_size": args.batch_size, "rounds": args.rounds, "steps": args.steps,
                           "median_step_s": job, "best_fixed_cap": best_cap, "trial": trial,
                           "tuning_steps": tuning_steps, "explanation": explanation, "transport": transport,
                           "load_average": os.getloadavg()[0]})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
