"""Training step time: gpucomm's DistributedOptimizer beside PyTorch DDP in the same job.

Both wrap identical copies of one model (default: a 9.4 M-parameter MLP) and train on the same
synthetic batches; rounds alternate between them (gpucomm, DDP, gpucomm, ...) so machine noise
hits both. DDP runs on Gloo for CPU tensors and NCCL for CUDA tensors, on its own process group.

    gpucomm-run -np 2 python benchmarks/optimizer_vs_ddp.py [--model mlp10m] [--json out.json]
    gpucomm-run -np 2 --single-gpu-test python benchmarks/optimizer_vs_ddp.py --cuda   # two ranks, one GPU
    gpucomm-run --mpi -np 2 python benchmarks/optimizer_vs_ddp.py --model cnn10m --cpu-operations gloo,mpi

``--cpu-operations`` picks gpucomm's CPU transport (``GPUCOMM_CPU_OPERATIONS``): ``auto`` (the
default: what ``hvd.init()`` chooses), ``gloo``, ``mpi``, or ``gloo,mpi`` to time gpucomm on both
transports beside DDP in one job (under an MPI launcher): the rounds then rotate between
``gpucomm-gloo``, ``gpucomm-mpi`` and ``ddp``, and gpucomm is shut down and initialized again on the
other transport between its two (untimed, with warm-up steps after each switch; the DDP group
stays). Each gpucomm variant's CPU collectives are counted per transport (``hvd.stats()``), so the
JSON proves which one carried its gradients.

Prints the median step time of each, the ratio gpucomm / DDP with the spread of the per-round
ratios, with ``--floor`` the same steps without any communication (the floor for both), and (GPU) the share of gradient-allreduce time hidden behind backward; writes JSON.
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
from typing import Any, Callable

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
TRANSPORTS = ("gloo", "mpi")
CHOICE_VAR = "GPUCOMM_CPU_OPERATIONS"


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
    ap.add_argument("--cpu-operations", default="auto",
                    help="gpucomm's CPU transport: auto (default: as hvd.init() decides), gloo, mpi, or gloo,mpi to "
                         "time both beside DDP (needs an MPI launcher: gpucomm-run --mpi, mpiexec)")
    ap.add_argument("--floor", action="store_true",
                    help="also time the same steps with no communication at all (a local model and optimizer), "
                         "interleaved: the floor no data-parallel step can go below, beside DDP's")
    ap.add_argument("--json", default="optimizer_vs_ddp.json")
    args = ap.parse_args()
    if args.fusion == "torch":
        os.environ["GPUCOMM_FUSION_KERNELS"] = "0"
    for key, value in zip(("batch_size", "rounds", "steps_per_round", "warmup"), QUICK if args.quick else FULL):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.batch_size, args.rounds, args.steps_per_round) < 1 or args.warmup < 0:
        usage_error("--batch-size, --rounds and --steps-per-round must be at least 1, --warmup at least 0")
    args.transports = transports(args.cpu_operations)
    if args.cuda and not torch.cuda.is_available():
        usage_error(f"--cuda needs a CUDA GPU, and torch.cuda.is_available() is False (torch {torch.__version__}); "
                    "leave --cuda out to run on CPU")
    return args


def transports(text: str) -> list[str | None]:
    """``--cpu-operations`` as the transports to time: ``[None]`` for auto (the job's own choice)."""
    if text == "auto":
        return [None]
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(t not in TRANSPORTS for t in names) or len(set(names)) != len(names):
        usage_error(f"--cpu-operations {text!r}: give auto, gloo, mpi, or gloo,mpi")
    return names


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


class GpucommVariant:
    """gpucomm's DistributedOptimizer on one CPU transport (``None``: the job's own), with its
    own copy of the model; ``activate`` re-initializes gpucomm on that transport when another is
    in use, and rebinds (or first builds) the optimizer on the new job."""

    active: str | None = None  # the transport the current gpucomm job runs on (None: as init chose)

    def __init__(self, name: str, transport: str | None, model: torch.nn.Module) -> None:
        self.name, self.transport, self.model = name, transport, model
        self.opt: Any = None
        self.counts = {"gloo": 0, "mpi": 0}  # CPU collectives of its timed steps, per transport

    def activate(self) -> bool:
        """Make the job run on this variant's transport; True when gpucomm was re-initialized (the
        optimizer then needs warm-up steps: its layout is agreed and its buckets cut anew)."""
        switched = self.transport is not None and GpucommVariant.active != self.transport
        if switched:
            hvd.shutdown()
            os.environ[CHOICE_VAR] = self.transport
            hvd.init()
            GpucommVariant.active = self.transport
        if self.opt is None:
            self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9),
                                                named_parameters=self.model.named_parameters())
            return True
        if switched:
            self.opt.rebind()
        return switched

    def count(self, before: dict, after: dict) -> None:
        for t in self.counts:
            self.counts[t] += after[f"{t}_collectives"] - before[f"{t}_collectives"]


def main() -> None:
    args = parse_args()
    first = args.transports[0]
    if first is not None:
        os.environ[CHOICE_VAR] = first
    hvd.init()
    GpucommVariant.active = first
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    if not args.cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    store = init_torch_group("nccl" if args.cuda else "gloo")
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    variants = [GpucommVariant("gpucomm" if len(args.transports) == 1 else f"gpucomm-{t}", t,
                               copy.deepcopy(base).to(device)) for t in args.transports]
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device),
                                                          device_ids=[device.index] if args.cuda else None)
    theirs = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    local_model = copy.deepcopy(base).to(device)
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
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

    def run_gpucomm(v: GpucommVariant, n: int) -> list[float]:
        if v.activate():
            timed(v.model, v.opt, max(2, args.warmup))  # the layout, the re-cut after step 1, then steady
        before = hvd.stats()
        t = timed(v.model, v.opt, n)
        v.count(before, hvd.stats())
        return t

    runs: dict[str, Callable[[int], list[float]]] = {v.name: (lambda n, v=v: run_gpucomm(v, n)) for v in variants}
    runs["ddp"] = lambda n: timed(ddp_model, theirs, n)
    if args.floor:  # the same steps with no communicator at all: what no data-parallel wrapper can beat
        runs["no-comm"] = lambda n: timed(local_model, local_opt, n)
    for v in variants:
        run_gpucomm(v, args.warmup)  # warm-up (and, with two transports, each one's first job)
    timed(ddp_model, theirs, args.warmup)
    if args.floor:
        timed(local_model, local_opt, args.warmup)
    for v in variants:
        v.counts = dict.fromkeys(v.counts, 0)
    names = list(runs)
    times: dict[str, list[float]] = {k: [] for k in names}
    round_ratios: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        medians = {}
        for name in (names if r % 2 == 0 else names[::-1]):  # one transport switch per round at most
            if args.floor:
                dist.barrier()  # the no-communication steps let the ranks drift apart: start each run together
            t = runs[name](args.steps_per_round)
            times[name] += t
            medians[name] = statistics.median(t)
        for v in variants:
            round_ratios[v.name].append(medians[v.name] / medians["ddp"])
    med = {k: statistics.median(v) for k, v in times.items()}
    # every rank measured; the job's step time is the slowest rank's
    every = hvd.allgather_object(med)
    job = {k: max(m[k] for m in every) for k in med}
    ratios = {v.name: job[v.name] / job["ddp"] for v in variants}
    main_name = variants[0].name
    if hvd.rank() == 0:
        params = sum(p.numel() for p in base.parameters())
        fusion = kernel_status() if args.cuda else None
        print(f"model {args.model} ({params / 1e6:.1f} M parameters), batch {args.batch_size} per rank, {hvd.size()} "
              f"ranks on {'GPU' if args.cuda else 'CPU'}; {args.rounds} interleaved rounds of {args.steps_per_round} steps")
        if fusion is not None:
            print(f"fusion copies: {fusion['path']} (kernel_fallbacks {hvd.stats()['kernel_fallbacks']}"
                  f"{', reason: ' + fusion['reason'] if fusion['reason'] else ''})")
        if not args.cuda:
            print("CPU collectives of the timed gpucomm steps, per transport: "
                  + "; ".join(f"{v.name}: gloo {v.counts['gloo']}, mpi {v.counts['mpi']}" for v in variants))
        print(f"{'':14s} {'median step (ms)':>18s}")
        for k in names:
            print(f"{k:14s} {job[k] * 1e3:18.2f}")
        for v in variants:
            rr = round_ratios[v.name]
            q, span = quartiles(rr), value_range(rr)
            print(f"ratio {v.name} / DDP: {ratios[v.name]:.3f}  (per-round ratios: median "
                  f"{fmt(statistics.median(rr), '.3f')}, quartiles {fmt_pair(q, '.3f')}, range {fmt_pair(span, '.3f')})")
        if args.floor:
            print(f"ratio no-comm / DDP: {job['no-comm'] / job['ddp']:.3f}  (the same steps without any communication "
                  f"or wrapper: no communicator's step can be below this; DDP spends "
                  f"{(job['ddp'] - job['no-comm']) * 1e3:.1f} ms per step beyond it)")
        with open(args.json, "w") as f:
            json.dump({"benchmark": "optimizer_vs_ddp", "model": args.model, "parameters": params,
                       "ranks": hvd.size(), "device": "cuda" if args.cuda else "cpu", "batch_size": args.batch_size,
                       "median_step_s": job, "ratio": ratios[main_name], "round_ratios": round_ratios[main_name],
                       "ratios": ratios, "round_ratios_by_variant": round_ratios,
                       "no_comm_floor_ratio": job["no-comm"] / job["ddp"] if args.floor else None,
                       "transport_collectives": {v.name: v.counts for v in variants},
                       "load_average": list(os.getloadavg()), "fusion": fusion,
                       "kernel_fallbacks": hvd.stats()["kernel_fallbacks"]}, f, indent=2)
        print(f"wrote {args.json}")
    dist.destroy_process_group()
    del store
    hvd.shutdown()


if __name__ == "__main__":
    main()
