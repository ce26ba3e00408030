"""Training step time: gpucomm's DistributedOptimizer beside PyTorch DDP in the same job.

Both wrap identical copies of one model (default: a 9.4 M-parameter MLP) and train on the same
synthetic batches; rounds alternate between them (gpucomm, DDP, gpucomm, ...) so machine noise
hits both. DDP runs on Gloo for CPU tensors and NCCL for CUDA tensors, on its own process group.

    gpucomm-run -np 2 python benchmarks/optimizer_vs_ddp.py [--model mlp10m] [--json out.json]
    gpucomm-run -np 2 --single-gpu-test python benchmarks/optimizer_vs_ddp.py --cuda   # two ranks, one GPU

Prints the median step time of each, the ratio gpucomm / DDP with the spread of the per-round
ratios, and (GPU) the share of gradient-allreduce time hidden behind backward; writes JSON.
``--quick`` is a smoke run (batch 8, 1 warm-up step, 2 rounds of 2 steps). Counts out of range, or
``--cuda`` without a GPU, end the run with one line on stderr and status 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from torch_group import init_torch_group  # noqa: E402
from bench_stats import fmt, fmt_pair, quartiles, value_range  # noqa: E402

# (batch per rank, rounds, steps per round, warm-up steps)
FULL = (32, 12, 8, 5)
QUICK = (8, 2, 2, 1)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp10m", choices=["mlp10m", "cnn10m", "cnn", "resnet50"])
    ap.add_argument("--batch-size", type=int, help=f"default {FULL[0]}")
    ap.add_argument("--rounds", type=int, help=f"default {FULL[1]}")
    ap.add_argument("--steps-per-round", type=int, help=f"default {FULL[2]}")
    ap.add_argument("--warmup", type=int, help=f"default {FULL[3]}")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: batch {QUICK[0]}, {QUICK[1]} rounds of {QUICK[2]} steps, {QUICK[3]} warm-up")
    ap.add_argument("--cuda", action="store_true", help="train on this rank's GPU (DDP then uses NCCL)")
    ap.add_argument("--fusion", choices=["kernels", "torch"], default="kernels",
                    help="GPU buckets: pack with the Numba kernels (default), or with torch ops, the fallback used "
                         "where the kernels cannot run (sets GPUCOMM_FUSION_KERNELS=0)")
    ap.add_argument("--json", default="optimizer_vs_ddp.json")
    args = ap.parse_args()
    if args.fusion == "torch":
        os.environ["GPUCOMM_FUSION_KERNELS"] = "0"
    for key, value in zip(("batch_size", "rounds", "steps_per_round", "warmup"), QUICK if args.quick else FULL):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.batch_size, args.rounds, args.steps_per_round) < 1 or args.warmup < 0:
        usage_error("--batch-size, --rounds and --steps-per-round must be at least 1, --warmup at least 0")
    if args.cuda and not torch.cuda.is_available():
        usage_error(f"--cuda needs a CUDA GPU, and torch.cuda.is_available() is False (torch {torch.__version__}); "
                    "leave --cuda out to run on CPU")
    return args


def kernel_status() -> dict:
    """How this rank packed its GPU buckets: ``kernels`` or ``torch`` ops, and why."""
    from gpucomm.kernels import status  # noqa: PLC0415

    st = status()
    path = "torch" if os.environ.get("GPUCOMM_FUSION_KERNELS") == "0" or not st["usable"] else "kernels"
    return {"path": path, "reason": st["reason"], "launch": st["launch"], "compiled": st["compiled"],
            "numpy_shims": st["numpy_shims"]}


def usage_error(message: str) -> None:
    print(f"optimizer_vs_ddp.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    args = parse_args()

    hvd.init()
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    if not args.cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    store = init_torch_group("nccl" if args.cuda else "gloo")
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    ours_model = copy.deepcopy(base).to(device)
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device),
                                                          device_ids=[device.index] if args.cuda else None)
    ours = hvd.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=ours_model.named_parameters())
    theirs = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g).to(device)
    target = (torch.randint(0, 1000, (args.batch_size,), generator=g)).to(device)

    def step(model, opt) -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def timed(model, opt, n: int) -> list[float]:
        out = []
        for _ in range(n):
            if args.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, opt)
            if args.cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    timed(ours_model, ours, args.warmup)
    timed(ddp_model, theirs, args.warmup)
    times: dict[str, list[float]] = {"gpucomm": [], "ddp": []}
    round_ratios = []
    for r in range(args.rounds):
        order = [("gpucomm", ours_model, ours), ("ddp", ddp_model, theirs)]
        if r % 2:
            order.reverse()
        medians = {}
        for name, model, opt in order:
            t = timed(model, opt, args.steps_per_round)
            times[name] += t
            medians[name] = statistics.median(t)
        round_ratios.append(medians["gpucomm"] / medians["ddp"])
    med = {k: statistics.median(v) for k, v in times.items()}
    # every rank measured; the job's step time is the slowest rank's
    every = hvd.allgather_object(med)
    job = {k: max(m[k] for m in every) for k in med}
    ratio = job["gpucomm"] / job["ddp"]
    q, span = quartiles(round_ratios), value_range(round_ratios)
    if hvd.rank() == 0:
        params = sum(p.numel() for p in base.parameters())
        fusion = kernel_status() if args.cuda else None
        print(f"model {args.model} ({params / 1e6:.1f} M parameters), batch {args.batch_size} per rank, {hvd.size()} "
              f"ranks on {'GPU' if args.cuda else 'CPU'}; {args.rounds} interleaved rounds of {args.steps_per_round} steps")
        if fusion is not None:
            print(f"fusion copies: {fusion['path']} (kernel_fallbacks {hvd.stats()['kernel_fallbacks']}"
                  f"{', reason: ' + fusion['reason'] if fusion['reason'] else ''})")
        print(f"{'':10s} {'median step (ms)':>18s}")
        for k in ("gpucomm", "ddp"):
            print(f"{k:10s} {job[k] * 1e3:18.2f}")
        print(f"ratio gpucomm / DDP: {ratio:.3f}  (per-round ratios: median "
              f"{fmt(statistics.median(round_ratios), '.3f')}, "
              f"quartiles {fmt_pair(q, '.3f')}, range {fmt_pair(span, '.3f')})")
        with open(args.json, "w") as f:
            json.dump({"benchmark": "optimizer_vs_ddp", "model": args.model, "parameters": params,
                       "ranks": hvd.size(), "device": "cuda" if args.cuda else "cpu", "batch_size": args.batch_size,
                       "median_step_s": job, "ratio": ratio, "round_ratios": round_ratios, "fusion": fusion,
                       "kernel_fallbacks": hvd.stats()["kernel_fallbacks"]}, f, indent=2)
        print(f"wrote {args.json}")
    dist.destroy_process_group()
    del store
    hvd.shutdown()


if __name__ == "__main__":
    main()
