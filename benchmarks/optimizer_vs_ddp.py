"""Training step time: gpucomm's DistributedOptimizer beside its fair anchors, interleaved in one job.

Every run times, on copies of one model (default: a 9.4 M-parameter MLP) built from the same weights
and fed the same synthetic batches:

    gpucomm      hvd.DistributedOptimizer
    ddp-default  PyTorch DDP at its defaults (gradient_as_bucket_view=False, static_graph=False)
    ddp-best     PyTorch DDP at its best (gradient_as_bucket_view=True, static_graph=True)
    no-comm      the same steps on a plain local model: no wrapper, no communication, the floor

(both DDP variants skip the buffer broadcast gpucomm does not do; see benchmarks/anchors.py). DDP runs
on Gloo for CPU tensors and NCCL for CUDA tensors, on its own process group.

    gpucomm-run -np 2 python benchmarks/optimizer_vs_ddp.py [--model mlp10m] [--json out.json]
    gpucomm-run -np 2 --single-gpu-test python benchmarks/optimizer_vs_ddp.py --cuda   # two ranks, one GPU
    gpucomm-run -np 1 python benchmarks/optimizer_vs_ddp.py --cuda                     # the one-rank reducer
    gpucomm-run --mpi -np 2 python benchmarks/optimizer_vs_ddp.py --model cnn10m --cpu-operations gloo,mpi

At 1 rank gpucomm runs its reducer (hooks, buckets, schedule) as DDP runs its own at size 1
(``GPUCOMM_ONE_RANK_REDUCER=1``; ``--one-rank-reducer off`` times the no-op optimizer instead), so the
reducer's own cost shows on one GPU: the run reports the time each variant adds over the floor and
gpucomm's added time as a share of ddp-best's (issue 35's target: at most 0.5). The counters of
gpucomm's timed steps (``hvd.stats()``) prove whether its reducer ran.

Method. After building, every variant takes the same number of untimed warm-up steps, one variant
after the other. Then ``--rounds`` rounds of ``--steps-per-round`` steps each: the order of the variants
changes every round (a Williams design: with 4 variants, every 4 rounds each variant runs first once and
follows each other variant once), so neither a place in the round nor what ran just before lands on one
variant. The heap built by then is left out of later garbage collections (``gc.freeze``), so one that
falls inside a block is short, whichever variant's garbage triggered it. Before each block, untimed: the
GPU is idle, a full garbage collection runs, the ranks meet at a barrier. Each step is timed alone (GPU:
synchronized before and after) for its wall time and the process's CPU time (every thread: NCCL's proxy
and socket threads, autograd's; the main thread's spin inside the closing synchronize is left out, see
benchmarks/anchor_steps.py). A step's wall time is the slowest rank's, its CPU time the ranks' mean; a
round's figure is the median of its steps; each variant shows the median of its rounds with their
quartiles, and the ratios against ddp-best and ddp-default are taken round by round (both ran back to
back), with their spread.

What this replaced (and why): DDP ran only at its defaults, with its buffer broadcast on; the floor was
optional (``--floor``, now always on and kept only as an accepted flag); gpucomm's first build took
``max(2, --warmup)`` extra warm-up steps that the other variants did not get; only wall time was shown.

``--cpu-operations`` picks gpucomm's CPU transport (``GPUCOMM_CPU_OPERATIONS``): ``auto`` (the
default: what ``hvd.init()`` chooses), ``gloo``, ``mpi``, or ``gloo,mpi`` to time gpucomm on both
transports (under an MPI launcher): ``gpucomm-gloo`` and ``gpucomm-mpi`` then take part in the rounds,
and gpucomm is shut down and initialized again on the other transport between them (untimed, with
``max(2, --warmup)`` warm-up steps after each switch, for that variant only; the DDP group stays). Each
gpucomm variant's CPU collectives are counted per transport, so the JSON proves which one carried its
gradients.

In the single-GPU test mode (``GPUCOMM_SINGLE_GPU_TEST=1``: ranks share one GPU and NCCL crosses
loopback sockets) the run sets ``NCCL_SOCKET_NTHREADS`` and ``NCCL_NSOCKS_PERTHREAD`` (unless already set;
values and source in benchmarks/anchors.py) before NCCL starts, and prints the values used.

``--zero-grad`` sets how every variant clears its gradients (``ZERO_GRAD_MODES``): torch's default frees them,
so each step's gradients are new tensors (gpucomm packs them into its buckets, DDP-best copies each into its bucket
view); ``keep-views`` lets gpucomm zero them in its buckets instead (``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS``), and
``in-place`` has every variant zero them where they are. The counters in the JSON (``grad_bucket_packs``,
``grad_bucket_views``) show which path gpucomm's buckets took.

``--quick`` is a smoke run (batch 8, 1 warm-up step, 4 rounds of 2 steps). Counts out of range, or
``--cuda`` without a GPU, end the run with one line on stderr and status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from torch_group import init_torch_group  # noqa: E402
from bench_stats import fmt, fmt_pair, ratio as safe_ratio  # noqa: E402
import anchors  # noqa: E402
from anchors import DDP_BEST, DDP_DEFAULT, DDP_KINDS, GPUCOMM, NO_COMM  # noqa: E402
import anchor_steps  # noqa: E402

# (batch per rank, rounds, steps per round, warm-up steps)
FULL = (32, 12, 8, 5)
QUICK = (8, 4, 2, 1)
TRANSPORTS = ("gloo", "mpi")
CHOICE_VAR = "GPUCOMM_CPU_OPERATIONS"
KEEP_VIEWS_VAR = "GPUCOMM_ZERO_GRAD_KEEPS_VIEWS"
ZERO_GRAD_MODES = {  # --zero-grad: how every variant clears its gradients before backward
    "free": "zero_grad(): torch's default set_to_none=True frees the gradients",
    "keep-views": f"zero_grad() with {KEEP_VIEWS_VAR}=1: gpucomm zeroes the gradients bound to its view buckets",
    "in-place": "zero_grad(set_to_none=False) for every variant: DDP-best keeps its bucket views too",
}
Samples = list[tuple[float, float]]  # (wall s, CPU s) per step


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
    ap.add_argument("--one-rank-reducer", choices=["on", "off"], default="on",
                    help="at 1 rank, run gpucomm's reducer at size 1 as DDP does (on, the default: "
                         f"{anchors.REDUCER_VAR}=1), or time its no-op optimizer (off)")
    ap.add_argument("--zero-grad", choices=ZERO_GRAD_MODES, default="free",
                    help="how every variant clears its gradients: free (zero_grad(), torch's default), keep-views "
                         "(the same call, with GPUCOMM_ZERO_GRAD_KEEPS_VIEWS=1: gpucomm zeroes the gradients in its "
                         "buckets instead of freeing them), in-place (zero_grad(set_to_none=False) for every "
                         "variant, DDP too)")
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)  # the floor is always timed now
    ap.add_argument("--json", default="optimizer_vs_ddp.json")
    args = ap.parse_args()
    if args.fusion == "torch":
        os.environ["GPUCOMM_FUSION_KERNELS"] = "0"
    os.environ[KEEP_VIEWS_VAR] = "1" if args.zero_grad == "keep-views" else "0"  # the mode decides, not the caller
    Variant.set_to_none = args.zero_grad != "in-place"
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


# ---------------------------------------------------------------------------------------------- variants


class Variant:
    """One model copy with its optimizer; ``prepare`` readies it for a block (True: it needs warm-up
    steps first), ``step`` trains one batch, ``after`` sees the counters around its timed steps."""

    set_to_none = True  # every variant's zero_grad (``--zero-grad``)

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> None:
        self.name, self.model, self.opt = name, model, opt

    def prepare(self) -> bool:
        return False

    def step(self, data: torch.Tensor, target: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=self.set_to_none)
        F.cross_entropy(self.model(data), target).backward()
        self.opt.step()

    def after(self, before: dict, after: dict) -> None:
        pass


class GpucommVariant(Variant):
    """gpucomm's DistributedOptimizer on one CPU transport (``None``: the job's own); ``prepare``
    re-initializes gpucomm on that transport when another is in use, and rebinds (or first builds) the
    optimizer on the new job."""

    active: str | None = None  # the transport the current gpucomm job runs on (None: as init chose)

    def __init__(self, name: str, transport: str | None, model: torch.nn.Module) -> None:
        super().__init__(name, model, None)
        self.transport = transport
        self.counts: dict[str, int] = {}  # hvd.stats() deltas over its timed steps

    def prepare(self) -> bool:
        """Make the job run on this variant's transport; True when gpucomm was re-initialized after the
        first build (the optimizer then needs warm-up steps: its layout is agreed and its buckets cut anew)."""
        switched = self.transport is not None and GpucommVariant.active != self.transport
        if switched:
            hvd.shutdown()
            os.environ[CHOICE_VAR] = self.transport
            hvd.init()
            GpucommVariant.active = self.transport
        if self.opt is None:
            self.opt = hvd.DistributedOptimizer(sgd(self.model), named_parameters=self.model.named_parameters())
            return False  # the first build: the common warm-up covers it
        if switched:
            self.opt.rebind()
        return switched

    def after(self, before: dict, after: dict) -> None:
        anchors.add_counts(self.counts, anchors.counter_delta(before, after))


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def build_variants(args: argparse.Namespace, device: torch.device) -> tuple[list[Variant], int, tuple[int, ...]]:
    """gpucomm (one per transport), ddp-default, ddp-best and no-comm, each on its own copy of the model
    (the same weights on every rank and in every copy); also the parameter count and the sample shape."""
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    params = sum(p.numel() for p in base.parameters())
    names = [GPUCOMM if len(args.transports) == 1 else f"{GPUCOMM}-{t}" for t in args.transports]
    cps = anchor_steps.copies(base, len(names) + 3, device)
    out: list[Variant] = [GpucommVariant(n, t, m) for n, t, m in zip(names, args.transports, cps)]
    for kind, model in zip(DDP_KINDS, cps[len(names):]):
        ddp = anchor_steps.build_ddp(model, kind, device)
        out.append(Variant(kind, ddp, sgd(ddp)))
    out.append(Variant(NO_COMM, cps[-1], sgd(cps[-1])))
    return out, params, sample


# ---------------------------------------------------------------------------------------------- timing


class Runner:
    """Warm-up and timed blocks of every variant on one batch, in the same order on every rank."""

    def __init__(self, variants: list[Variant], sample: tuple[int, ...], args: argparse.Namespace,
                 device: torch.device) -> None:
        self.variants = {v.name: v for v in variants}
        self.args, self.device = args, device
        g = torch.Generator().manual_seed(hvd.rank())
        self.data = torch.randn(args.batch_size, *sample, generator=g).to(device)
        self.target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)

    def stepper(self, v: Variant) -> Callable[[], None]:
        return lambda: v.step(self.data, self.target)

    def warm_up(self) -> None:
        """The same number of untimed steps for every variant (one-off costs such as cuDNN's autotuning
        or lazy kernel loading land in whichever runs first, all before the timed rounds)."""
        for v in self.variants.values():
            v.prepare()
            for _ in range(self.args.warmup):
                v.step(self.data, self.target)

    def block(self, name: str) -> Samples:
        """One variant's timed steps of a round."""
        v = self.variants[name]
        if v.prepare():  # gpucomm switched transport: its job is new
            for _ in range(max(2, self.args.warmup)):
                v.step(self.data, self.target)
        anchor_steps.settle(self.device)
        anchor_steps.barrier(self.device)
        before = hvd.stats()
        samples = anchor_steps.time_steps(self.stepper(v), self.args.steps_per_round, self.device)
        v.after(before, hvd.stats())
        return samples

    def rounds(self, orders: list[list[str]]) -> dict[str, list[Samples]]:
        """Every round in its order: this rank's [(wall, CPU)] per variant, round and step."""
        out: dict[str, list[Samples]] = {name: [] for name in self.variants}
        for order in orders:
            for name in order:
                out[name].append(self.block(name))
        return out


# ---------------------------------------------------------------------------------------------- results


def summarize(wall: dict[str, list[float]], cpu: dict[str, list[float]], labels: dict[str, str]) -> dict[str, Any]:
    """The JSON's figures from the job's per-round wall and CPU seconds per step of each variant."""
    variants = {}
    for name in wall:
        w, c = anchors.spread(wall[name]), anchors.spread(cpu[name])
        variants[name] = {"label": labels[name], "wall_s_per_step": w["median"], "wall_quartiles": w["quartiles"],
                          "wall_range": w["range"], "cpu_s_per_step": c["median"], "cpu_quartiles": c["quartiles"],
                          "cpu_range": c["range"], "round_wall_s": wall[name], "round_cpu_s": cpu[name]}
    med = {n: v["wall_s_per_step"] for n, v in variants.items()}
    ratios = {f"vs_{a.replace('-', '_')}": {n: safe_ratio(med[n], med[a]) for n in med} for a in DDP_KINDS}
    round_ratios = {f"vs_{a.replace('-', '_')}": {n: anchors.paired_ratios(wall[n], wall[a]) for n in wall}
                    for a in DDP_KINDS}
    added = {"wall_s": anchors.added_over_floor(wall), "cpu_s": anchors.added_over_floor(cpu)}
    ours = next(n for n in wall if n.startswith(GPUCOMM))
    added["gpucomm_vs_ddp_best"] = {k: anchors.added_ratio(added[k], ours) for k in ("wall_s", "cpu_s")}
    added["target"] = anchors.TARGET_ADDED_RATIO
    return {"variants": variants, "median_step_s": med,
            "cpu_s_per_step": {n: v["cpu_s_per_step"] for n, v in variants.items()},
            "ratio": ratios["vs_ddp_best"][ours], "ratios": ratios, "round_ratios": round_ratios,
            "no_comm_floor_ratio": ratios["vs_ddp_best"][NO_COMM], "added_over_floor": added}


def _ms(seconds: float | None, spec: str = ".2f") -> str:
    return fmt(None if seconds is None else seconds * 1e3, spec)


def _ms_pair(pair: list[float] | None) -> str:
    return fmt_pair(None if pair is None else [x * 1e3 for x in pair], ".2f")


def table(res: dict[str, Any]) -> list[str]:
    """Each variant's wall and CPU ms per step (round quartiles) and its ratios to both DDP anchors."""
    lines = [f"{'variant':20s} {'wall ms/step':>12s} {'round IQR':>15s} {'CPU ms/step':>12s} {'round IQR':>15s} "
             f"{'vs ddp-best':>11s} {'vs ddp-default':>14s}"]
    for name, v in res["variants"].items():
        lines.append(f"{v['label']:20s} {_ms(v['wall_s_per_step']):>12s} {_ms_pair(v['wall_quartiles']):>15s} "
                     f"{_ms(v['cpu_s_per_step']):>12s} {_ms_pair(v['cpu_quartiles']):>15s} "
                     f"{fmt(res['ratios']['vs_ddp_best'][name], '.3f'):>11s} "
                     f"{fmt(res['ratios']['vs_ddp_default'][name], '.3f'):>14s}")
    return lines


def floor_lines(res: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """What each variant adds over the no-comm floor, and gpucomm's share of ddp-best's."""
    added = res["added_over_floor"]
    parts = [f"{labels[n]} {_ms(w['median'])} / {_ms(added['cpu_s'][n]['median'])}" for n, w in added["wall_s"].items()]
    share = added["gpucomm_vs_ddp_best"]
    return ["added over the no-comm floor, wall / CPU ms per step (median of the per-round differences): "
            + "; ".join(parts),
            f"gpucomm adds {fmt(share['wall_s'], '.2f')}x what ddp-best adds in wall time, "
            f"{fmt(share['cpu_s'], '.2f')}x in CPU time (issue 35's target: <= {added['target']}x)"]


def ratio_lines(res: dict[str, Any], labels: dict[str, str]) -> list[str]:
    lines = []
    for anchor, key in ((DDP_BEST, "vs_ddp_best"), (DDP_DEFAULT, "vs_ddp_default")):
        for name, r in res["round_ratios"][key].items():
            if name.startswith(GPUCOMM):
                lines.append(f"ratio {labels[name]} / {anchor}: {fmt(res['ratios'][key][name], '.3f')}  (per-round "
                             f"ratios: median {fmt(r['median'], '.3f')}, quartiles {fmt_pair(r['quartiles'], '.3f')}, "
                             f"range {fmt_pair(r['range'], '.3f')})")
    return lines


def main() -> None:
    args = parse_args()
    sockets = anchors.tune_sockets()
    anchors.ask_one_rank_reducer(args.one_rank_reducer == "on")
    first = args.transports[0]
    if first is not None:
        os.environ[CHOICE_VAR] = first
    hvd.init()
    GpucommVariant.active = first
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    if not args.cuda:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // hvd.local_size()))  # the cores this rank may use
    store = init_torch_group("nccl" if args.cuda else "gloo")
    variants, params, sample = build_variants(args, device)
    runner = Runner(variants, sample, args, device)
    names = [v.name for v in variants]
    orders = anchors.round_orders(names, args.rounds)
    runner.warm_up()
    anchor_steps.freeze_heap()
    for v in variants:
        if isinstance(v, GpucommVariant):
            v.counts = {}
    local = runner.rounds(orders)
    anchor_steps.thaw_heap()
    wall, cpu = anchor_steps.job_rounds(hvd.allgather_object(local))
    gp = [v for v in variants if isinstance(v, GpucommVariant)]
    total: dict[str, int] = {}
    for v in gp:
        anchors.add_counts(total, v.counts)
    reducer = anchors.reducer_record(hvd.size(), args.one_rank_reducer == "on", total)
    labels = {n: n for n in names}
    if hvd.size() == 1 and len(gp) == 1:
        labels[gp[0].name] = anchors.gpucomm_label(1, bool(reducer["verified"]))
    if hvd.rank() == 0:
        report(args, params, device, summarize(wall, cpu, labels), labels, orders, sockets, reducer, gp)
    dist.destroy_process_group()
    del store
    hvd.shutdown()


def report(args: argparse.Namespace, params: int, device: torch.device, res: dict[str, Any], labels: dict[str, str],
           orders: list[list[str]], sockets: dict[str, Any], reducer: dict[str, Any], gp: list[GpucommVariant]) -> None:
    """Rank 0's printout and JSON."""
    fusion = kernel_status() if args.cuda else None
    balance = anchors.balance_note(len(orders[0]), args.rounds)
    print(f"model {args.model} ({params / 1e6:.1f} M parameters), batch {args.batch_size} per rank, {hvd.size()} "
          f"ranks on {'GPU' if args.cuda else 'CPU'}; {args.rounds} interleaved rounds of {args.steps_per_round} steps "
          f"after {args.warmup} warm-up step{'' if args.warmup == 1 else 's'} per variant; order of round 1: "
          f"{', '.join(orders[0])}")
    print(f"zero_grad: {args.zero_grad} ({ZERO_GRAD_MODES[args.zero_grad]})")
    print("DDP: " + "; ".join(f"{k} " + ", ".join(f"{a}={b}" for a, b in anchor_steps.ddp_keywords(k).items())
                              for k in DDP_KINDS))
    print(anchors.socket_text(sockets))
    if fusion is not None:
        print(f"fusion copies: {fusion['path']} (kernel_fallbacks {hvd.stats()['kernel_fallbacks']}"
              f"{', reason: ' + fusion['reason'] if fusion['reason'] else ''})")
    if not args.cuda:
        print("CPU collectives of the timed gpucomm steps, per transport: "
              + "; ".join(f"{v.name}: gloo {v.counts.get('gloo_collectives', 0)}, "
                          f"mpi {v.counts.get('mpi_collectives', 0)}" for v in gp))
    print("\n".join(table(res) + floor_lines(res, labels) + ratio_lines(res, labels)))
    for line in (anchors.reducer_line(reducer), balance and f"note: {balance}"):
        if line:
            print(line)
    doc = {"benchmark": "optimizer_vs_ddp", "model": args.model, "parameters": params, "ranks": hvd.size(),
           "device": "cuda" if args.cuda else "cpu", "batch_size": args.batch_size, "rounds": args.rounds,
           "steps_per_round": args.steps_per_round, "warmup": args.warmup, "zero_grad": args.zero_grad, **res,
           "labels": labels,
           "round_orders": orders, "balanced": balance is None,
           "ddp_options": {k: anchor_steps.ddp_keywords(k) for k in DDP_KINDS}, "nccl_sockets": sockets,
           "one_rank_reducer": reducer, "gpucomm_counters": {v.name: v.counts for v in gp},
           "transport_collectives": {v.name: {t: v.counts.get(f"{t}_collectives", 0) for t in TRANSPORTS} for v in gp},
           "load_average": list(os.getloadavg()), "fusion": fusion, "kernel_fallbacks": hvd.stats()["kernel_fallbacks"]}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
