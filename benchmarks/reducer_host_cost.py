"""The reducer's own host cost per training step: gpucomm's DistributedOptimizer beside DDP at its defaults,
DDP at its best and no communication at all (and gpucomm with a Python hook per gradient, as before its hooks
by arrival order: ``GPUCOMM_HOOKS_BY_ARRIVAL_ORDER=0``), on a model whose backward costs almost nothing, so that what
each variant adds over the floor is its per-parameter and per-bucket host work (hooks, bucket launches, the
step's waits and writes) and not the model's compute or the bytes moved.

The model (``ParamBank``) holds one parameter per parameter of ResNet-50 (161, in its order), each a flat
tensor of ``numel // --scale`` elements (default 4096: about 6,300 elements in all), and its forward is
``x * sum(p.sum())``: backward is one small node per parameter. The step is ``zero_grad()`` (torch's default:
the gradients are freed), forward, backward, ``optimizer.step()`` (SGD). Each variant runs on its own copy of
the weights; rounds interleave the variants (a Williams design, as ``optimizer_vs_ddp.py``); each step is
timed alone, wall and process CPU; a round's figure is the median of its steps, a variant's the median of
its rounds. At one rank gpucomm runs its reducer (``GPUCOMM_ONE_RANK_REDUCER=1``, as DDP runs its own at size
1), and its counters prove it ran.

    python benchmarks/reducer_host_cost.py                      # one rank, CPU
    gpucomm-run -np 2 python benchmarks/reducer_host_cost.py    # two ranks (then the bytes cross Gloo too)
    python benchmarks/reducer_host_cost.py --cuda               # one GPU (the kernel path's host work)

Prints each variant's ms per step (wall, CPU), what it adds over no-comm, and gpucomm's added time as a
share of ddp-best's (issue 35's target: at most 0.5); writes ``--json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import anchors  # noqa: E402
from anchor_steps import barrier, build_ddp, copies, freeze_heap, job_rounds, settle, thaw_heap, time_steps  # noqa: E402
from bench_stats import fmt, median, ratio, spread, write_json  # noqa: E402

SCHEMA = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=4096, help="each parameter holds numel // scale elements (min 1)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 rounds of 4 steps, 3 warm-up")
    ap.add_argument("--cuda", action="store_true", help="on this rank's GPU (DDP then uses NCCL)")
    ap.add_argument("--one-rank-reducer", choices=["on", "off"], default="on")
    ap.add_argument("--json", default="reducer_host_cost.json")
    args = ap.parse_args(argv)
    if args.scale < 1:
        ap.error("--scale must be at least 1")
    if args.quick:
        args.rounds, args.steps_per_round, args.warmup = 4, 4, 3
    return args


class ParamBank(torch.nn.Module):
    """One flat parameter per given size; forward ``x * sum(p.sum())``, so backward is one node per parameter."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the registered parameters themselves (ParameterList's indexing is several Python calls per item)
        return x * torch.stack([p.sum() for p in self.params._parameters.values()]).sum()


PER_GRADIENT = "gpucomm-hook-per-grad"  # gpucomm with a Python hook per gradient (GPUCOMM_HOOKS_BY_ARRIVAL_ORDER=0)


def per_gradient_hooks(hvd: Any, opt: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """gpucomm's DistributedOptimizer keeping a Python hook per gradient (as before hooks by arrival order):
    the same reducer, so the difference to the ``gpucomm`` row is what those hooks cost."""
    caller = os.environ.get("GPUCOMM_HOOKS_BY_ARRIVAL_ORDER")
    os.environ["GPUCOMM_HOOKS_BY_ARRIVAL_ORDER"] = "0"
    try:
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    finally:  # the caller's own setting (it decides the gpucomm row) as it was
        if caller is None:
            del os.environ["GPUCOMM_HOOKS_BY_ARRIVAL_ORDER"]
        else:
            os.environ["GPUCOMM_HOOKS_BY_ARRIVAL_ORDER"] = caller


def resnet50_sizes(scale: int) -> list[int]:
    """ResNet-50's parameter sizes in its order, each divided by ``scale`` (at least 1 element)."""
    import models  # noqa: PLC0415 - examples/models.py: torchvision's ResNet-50 or the examples' own

    net, _ = models.build("resnet50")
    return [max(1, p.numel() // scale) for p in net.parameters()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    anchors.ask_one_rank_reducer(args.one_rank_reducer == "on")
    import gpucomm.torch as hvd  # noqa: PLC0415 - after the reducer switch
    from torch_group import init_torch_group  # noqa: PLC0415

    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    store = init_torch_group("nccl" if args.cuda else "gloo")
    torch.manual_seed(0)
    sizes = resnet50_sizes(args.scale)
    base = ParamBank(sizes)
    names = [anchors.GPUCOMM, PER_GRADIENT, *anchors.ANCHORS]
    models = dict(zip(names, copies(base, len(names), device)))
    steps: dict[str, Any] = {}
    for name, model in models.items():
        if name in anchors.DDP_KINDS:
            model = build_ddp(model, name, device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        if name in (anchors.GPUCOMM, PER_GRADIENT):
            opt = per_gradient_hooks(hvd, opt, model) if name == PER_GRADIENT else \
                hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        x = torch.ones(1, device=device)

        def step(model=model, opt=opt, x=x) -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        steps[name] = step
    for name in names:  # the same untimed warm-up for every variant
        for _ in range(args.warmup):
            steps[name]()
    freeze_heap()
    orders = anchors.round_orders(names, args.rounds)
    mine: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in names}
    counts: dict[str, int] = {}
    for order in orders:
        for name in order:
            settle(device)
            barrier(device)
            before = hvd.stats() if name == anchors.GPUCOMM else None
            mine[name].append(time_steps(steps[name], args.steps_per_round, device))
            if before is not None:
                anchors.add_counts(counts, anchors.counter_delta(before, hvd.stats()))
    thaw_heap()
    every = hvd.allgather_object(mine, name="reducer_host_cost.rounds")
    wall, cpu = job_rounds(every)
    ranks = hvd.size()
    label = anchors.gpucomm_label(ranks, args.one_rank_reducer == "on")
    floor_wall, floor_cpu = median(wall[anchors.NO_COMM]), median(cpu[anchors.NO_COMM])
    variants = {}
    for name in names:
        w, c = median(wall[name]), median(cpu[name])
        variants[name] = {"label": label if name == anchors.GPUCOMM else name, "wall_ms": w * 1e3, "cpu_ms": c * 1e3,
                          "wall_ms_rounds": spread([v * 1e3 for v in wall[name]]),
                          "added_wall_ms": (w - floor_wall) * 1e3, "added_cpu_ms": (c - floor_cpu) * 1e3}
    share = {kind: ratio(variants[anchors.GPUCOMM]["added_wall_ms"], variants[kind]["added_wall_ms"])
             for kind in anchors.DDP_KINDS}
    share_per_gradient = {kind: ratio(variants[PER_GRADIENT]["added_wall_ms"], variants[kind]["added_wall_ms"])
                          for kind in anchors.DDP_KINDS}
    reducer = anchors.reducer_record(ranks, args.one_rank_reducer == "on", counts)
    doc = {"schema": SCHEMA, "tool": "reducer_host_cost", "ranks": ranks, "device": str(device),
           "torch": torch.__version__, "parameters": len(sizes), "elements": sum(sizes), "scale": args.scale,
           "rounds": args.rounds, "steps_per_round": args.steps_per_round, "warmup": args.warmup,
           "round_orders": orders, "variants": variants, "gpucomm_added_over_ddp_added": share,
           "per_gradient_hooks_added_over_ddp_added": share_per_gradient,
           "target_added_ratio": anchors.TARGET_ADDED_RATIO, "reducer": reducer,
           "counters_per_step": {k: v / (args.rounds * args.steps_per_round) for k, v in counts.items() if v}}
    if hvd.rank() == 0:
        print(f"reducer host cost: {len(sizes)} parameters (ResNet-50's, each numel // {args.scale}; "
              f"{sum(sizes)} elements), {ranks} rank(s), {device}, torch {torch.__version__}; "
              f"{args.rounds} rounds x {args.steps_per_round} steps, interleaved")
        print(f"{'variant':24s} {'wall ms':>9s} {'CPU ms':>9s} {'added wall':>11s} {'added CPU':>10s}")
        for name in names:
            v = variants[name]
            print(f"{v['label']:24s} {v['wall_ms']:9.3f} {v['cpu_ms']:9.3f} {v['added_wall_ms']:11.3f} "
                  f"{v['added_cpu_ms']:10.3f}")
        print("gpucomm's added wall time / DDP's: " + ", ".join(f"{k} {fmt(share[k], '.2f')}" for k in anchors.DDP_KINDS)
              + f" (issue 35's target against ddp-best: <= {anchors.TARGET_ADDED_RATIO}); with a hook per gradient: "
              + ", ".join(f"{k} {fmt(share_per_gradient[k], '.2f')}" for k in anchors.DDP_KINDS))
        line = anchors.reducer_line(reducer)
        if line:
            print(line)
        write_json(args.json, doc)
    import torch.distributed as dist  # noqa: PLC0415

    dist.destroy_process_group()
    del store
    hvd.shutdown()
    return doc


if __name__ == "__main__":
    main()
