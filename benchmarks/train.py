"""Synthetic training throughput: gpucomm's DistributedOptimizer beside its fair anchors in the same job.

For each model, copies built from the same weights (checked) train on the same random batches:

    gpucomm      hvd.DistributedOptimizer (at 1 rank with its reducer on, see below)
    ddp-default  PyTorch DDP at its defaults (gradient_as_bucket_view=False, static_graph=False)
    ddp-best     PyTorch DDP at its best (gradient_as_bucket_view=True, static_graph=True)
    no-comm      a plain copy with no wrapper and no communication: the floor

(NCCL for CUDA tensors, Gloo for CPU tensors, on DDP's own process group; both DDP variants skip the
buffer broadcast gpucomm does not do, see benchmarks/anchors.py). After the same warm-up for every
variant, rounds of K steps run every variant in an order that changes each round (a Williams design:
with 4 variants, every 4 rounds each runs first once and after each other variant once). Before each
block, untimed: the GPU idle, a full garbage collection, a barrier; the heap built before the rounds is
left out of collections (``gc.freeze``), so one inside a block is short whoever triggered it. A block's
wall time runs from an idle GPU to the end of its GPU work, and the process's CPU time is taken over the
same interval (every thread; see benchmarks/anchor_steps.py); the job's wall time for a round is its
slowest rank's, its CPU time the ranks' mean. Every figure is the median of the rounds with their
quartiles, and every ratio (against ddp-best, ddp-default and the floor) is taken round by round, where
both ran back to back.

    gpucomm-run -np 2 python benchmarks/train.py --device cpu --quick        # under a minute on 2 cores
    gpucomm-run -np 4 python benchmarks/train.py                            # one GPU per rank
    gpucomm-run -np 2 --single-gpu-test python benchmarks/train.py          # two ranks, one GPU (loopback)

At 1 rank gpucomm runs its reducer (hooks, buckets, schedule) at size 1 as DDP runs its own
(``GPUCOMM_ONE_RANK_REDUCER=1``; ``--one-rank-reducer off`` for the no-op optimizer): the table then
shows what each variant adds over the floor, and gpucomm's added time as a share of ddp-best's (issue
35's target: at most 0.5); the counters of gpucomm's timed steps say whether its reducer ran. In the
single-GPU test mode the run sets NCCL's socket threads (``NCCL_SOCKET_NTHREADS``,
``NCCL_NSOCKS_PERTHREAD``, unless already set) before NCCL starts and prints the values used.

Why an earlier version reported "gpucomm/plain 1.081" at 1 rank on an H100 (2026-11-27): at size 1
gpucomm's optimizer removes its hooks when it binds (gpucomm/torch/optimizer.py ``_bind``: ``if
self._size == 1: ... hook.remove()``) and its synchronize returns at once (``_reduce_step``: ``if
self._size == 1: ... return False``), so a gpucomm step was the plain step plus a few Python calls: it
cannot be 8 % faster. The figure measured the method:
  1. the order rotated (``variants[k:] + variants[:k]``, ``k = r % 3``) over verify_gpu's 4 rounds:
     gpucomm ran first in 2 rounds of 4, plain ran right after DDP in 3 of 4 and gpucomm after DDP in 1,
     so what one variant leaves behind (DDP's NCCL work and watchdog, its buckets in the caching
     allocator, caches) was charged to the same successor every time;
  2. "gpucomm/plain" was a ratio of two medians of 4 rounds (each the mean of the middle two) of 5
     steps (~0.13 s per round, launch-bound), not paired round by round, and printed with no spread; the
     same run's per-round gpucomm/DDP ratios spread 1.102-1.217 between their quartiles, so rounds that
     short move by 5-10 %;
  3. warm-up ran once per variant in a fixed order and nothing reset the state between timed blocks
     (a garbage collection triggered by one variant's garbage could land in the next one's block);
  4. rounds were timed with CUDA events, which for a launch-bound step measure the host's issue rate,
     and the host's CPU time was not shown, so nothing could tell a host stall from GPU work.
The fix is above: a balanced order, equal warm-up, the same initial weights (checked), a settled
start for every block, per-round paired ratios with quartiles, CPU time beside wall time, and at 1
rank a gpucomm that does the reducer's work (the no-op one was never a fair comparison with DDP's
reducer). With ``--rounds`` not a multiple of the design's size the run says so.

Models: ``resnet50`` when torchvision is installed, otherwise the built-in ``cnn`` and ``transformer``
(``--models`` chooses; ``--quick`` on CPU defaults to ``cnn,transformer``). Throughput is in samples/s
(images/s for the image models), per device and for the whole job.

Scaling efficiency needs the 1-rank number from a 1-rank run (N ranks on N devices do not tell it).
A verification run therefore chains two jobs with the same flags; the first one's JSON is the baseline:

    gpucomm-run -np 1 python benchmarks/train.py --json train_1.json
    gpucomm-run -np 8 python benchmarks/train.py --baseline train_1.json --json train_8.json --plot train_8.png

efficiency = total samples/s at N ranks / (N x samples/s at 1 rank), for each variant against the same
variant at 1 rank (gpucomm against gpucomm, ddp-best against ddp-best, ...). The baseline must have the
same device kind, batch size and models, and every variant; anything else is refused with the
difference named.

On CPUs each rank uses ``OMP_NUM_THREADS`` threads when that is set, else the host's cores divided by
its ranks; set it to compare a 1-rank baseline and an N-rank run at the same threads per rank.

Rank 0 shows progress (one updating line on a terminal, a plain line every few seconds otherwise),
prints a table, writes JSON (``--json``) and, with ``--plot``, a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from torch_group import init_torch_group  # noqa: E402
import anchor_steps  # noqa: E402
import anchors  # noqa: E402
from anchors import DDP_BEST, DDP_DEFAULT, DDP_KINDS, GPUCOMM, NO_COMM  # noqa: E402
import bench_stats  # noqa: E402

import gpucomm  # noqa: E402
import gpucomm.torch as hvd  # noqa: E402

VARIANTS = (GPUCOMM, DDP_DEFAULT, DDP_BEST, NO_COMM)
# (batch per rank, warm-up steps per variant, rounds, steps per round); rounds a multiple of 4 balance the order
FULL = (32, 5, 12, 10)
QUICK = (8, 2, 8, 3)


@dataclass
class Variant:
    """One copy of the model with its optimizer; ``step()`` trains it on one batch. ``counts``: the
    gpucomm counters that moved during its timed steps (gpucomm only)."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    counts: dict[str, int] = field(default_factory=dict)

    def step(self, data: torch.Tensor, target: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(data), target).backward()
        self.optimizer.step()


# ---------------------------------------------------------------------------------------------- set-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--models", type=lambda s: [m for m in s.split(",") if m], default=None,
                    help=f"comma-separated, from {', '.join(models.MODELS)} (default: resnet50 when torchvision "
                         "is installed, else cnn,transformer)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: this rank's GPU when torch sees one, else CPU")
    ap.add_argument("--quick", action="store_true",
                    help=f"small run: batch {QUICK[0]}, {QUICK[1]} warm-up step, {QUICK[2]} rounds of {QUICK[3]} steps")
    ap.add_argument("--batch-size", type=int, help=f"samples per rank and step (default {FULL[0]})")
    ap.add_argument("--warmup", type=int, help=f"warm-up steps per variant and model (default {FULL[1]})")
    ap.add_argument("--rounds", type=int, help=f"interleaved timed rounds (default {FULL[2]}; at least 2)")
    ap.add_argument("--steps-per-round", type=int, help=f"steps per variant and round (default {FULL[3]})")
    ap.add_argument("--one-rank-reducer", choices=["on", "off"], default="on",
                    help="at 1 rank, run gpucomm's reducer at size 1 as DDP does (on, the default: "
                         f"{anchors.REDUCER_VAR}=1), or time its no-op optimizer (off)")
    ap.add_argument("--baseline", metavar="JSON", help="a 1-rank run's JSON: report scaling efficiency against it")
    ap.add_argument("--json", default="train_bench.json", metavar="PATH", help="results (default %(default)s)")
    ap.add_argument("--plot", metavar="PNG", help="also draw throughput (and scaling efficiency) to this PNG")
    ap.add_argument("--progress-interval", type=float, default=5.0, metavar="S",
                    help="seconds between progress lines when stdout is not a terminal (default %(default)s)")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, default in zip(("batch_size", "warmup", "rounds", "steps_per_round"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the spread needs two rounds)")
    if min(args.batch_size, args.steps_per_round) < 1 or args.warmup < 0:
        ap.error("--batch-size and --steps-per-round must be positive, --warmup not negative")
    unknown = [m for m in args.models or [] if m not in models.MODELS]
    if unknown or args.models == []:
        ap.error(f"--models: unknown {', '.join(unknown) or '(empty list)'}; choose from {', '.join(models.MODELS)}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"{flag} {path}: its folder does not exist (checked now, not after the run)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    return args


def default_models(device: torch.device, quick: bool) -> list[str]:
    """ResNet-50 is the reference workload, but only torchvision's is the one people compare with, and
    on a CPU it is far too slow for a quick run: then the built-in small CNN and transformer."""
    if importlib.util.find_spec("torchvision") is not None and not (quick and device.type == "cpu"):
        return ["resnet50"]
    return ["cnn", "transformer"]


def cpu_threads() -> int:
    """Threads per CPU rank: ``OMP_NUM_THREADS`` when set, else this host's cores shared by its ranks."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, (os.cpu_count() or 1) // hvd.local_size())


def pick_device(choice: str) -> torch.device:
    """This rank's GPU (``hvd.init()`` pinned it by PCI bus id) or the CPU, after ``hvd.init()``."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(cpu_threads())
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch sees no CUDA GPU (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda}); install a CUDA build of torch, check the driver, or use --device cpu")
    torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels, as Horovod's does
    return torch.device("cuda", torch.cuda.current_device())


def check_baseline(path: str, args: argparse.Namespace, device: torch.device,
                   params: dict[str, int]) -> dict[str, Any]:
    """The 1-rank run's JSON, after checking that it measured the same thing; SystemExit names the difference."""
    try:
        with open(path) as f:
            base = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--baseline {path}: cannot read it as JSON ({e})") from None
    if base.get("benchmark") != "train":
        raise SystemExit(f"--baseline {path}: not a benchmarks/train.py result (benchmark={base.get('benchmark')!r})")
    wanted = {"ranks": 1, "device": device.type, "batch_size": args.batch_size}
    for key, value in wanted.items():
        if base.get(key) != value:
            raise SystemExit(f"--baseline {path}: its {key} is {base.get(key)!r}, this run needs {value!r} "
                             f"(make the baseline with gpucomm-run -np 1 and the same --device and --batch-size)")
    for name, count in params.items():
        theirs = base.get("models", {}).get(name)
        if theirs is None:
            have = ", ".join(base.get("models", {})) or "none"
            raise SystemExit(f"--baseline {path}: has no {name!r} (it has {have}); "
                             f"run the 1-rank job with --models {','.join(params)}")
        if theirs.get("parameters") != count:
            raise SystemExit(f"--baseline {path}: its {name!r} has {theirs.get('parameters')} parameters, "
                             f"this one {count}: the model changed since the baseline was made")
        missing = [v for v in VARIANTS if not _positive_rate(theirs, v)]
        if missing:
            raise SystemExit(f"--baseline {path}: its {name!r} has no samples/s for {', '.join(missing)} "
                             "(a partial or hand-edited file, or one made before these variants existed); make it "
                             "again with gpucomm-run -np 1")
    return base


def _positive_rate(model: dict[str, Any], variant: str) -> bool:
    rate = ((model.get("variants") or {}).get(variant) or {}).get("samples_per_s_per_device")
    return isinstance(rate, (int, float)) and rate > 0


def agreed_baseline(args: argparse.Namespace, device: torch.device, names: list[str]) -> dict[str, Any] | None:
    """Rank 0 reads and checks ``--baseline``; every rank gets the result or stops with the same message."""
    if not args.baseline:
        return None
    verdict: Any = None
    if hvd.rank() == 0:
        params = {n: sum(p.numel() for p in models.build(n)[0].parameters()) for n in names}
        try:
            verdict = check_baseline(args.baseline, args, device, params)
        except SystemExit as e:
            verdict = str(e)
    verdict = hvd.broadcast_object(verdict, 0, name="train_baseline")
    if isinstance(verdict, str):
        raise SystemExit(verdict)
    return verdict


def baseline_notes(baseline: dict[str, Any] | None, device: torch.device) -> list[str]:
    """Caveats on the efficiency numbers: on CPUs, ranks share the cores, so a 1-rank baseline that
    ran with more threads per rank mixes thread scaling into rank scaling."""
    if baseline is None or device.type != "cpu" or baseline.get("threads_per_rank") == torch.get_num_threads():
        return []
    return [f"the baseline ran {baseline.get('threads_per_rank')} threads per rank, this run "
            f"{torch.get_num_threads()}: CPU scaling efficiency includes that difference"]


def build_variants(name: str, device: torch.device) -> tuple[list[Variant], int, tuple[int, ...]]:
    """gpucomm, ddp-default, ddp-best and no-comm on copies of ``name`` with the same weights (same seed
    on every rank, and checked across the copies)."""
    torch.manual_seed(0)
    base, sample = models.build(name)
    params = sum(p.numel() for p in base.parameters())

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    ours, *ddp_models, plain = anchor_steps.copies(base, len(VARIANTS), device)
    ours_opt = hvd.DistributedOptimizer(sgd(ours), named_parameters=ours.named_parameters())
    hvd.broadcast_parameters(ours.state_dict(), root_rank=0)
    variants = [Variant(GPUCOMM, ours, ours_opt)]
    for kind, model in zip(DDP_KINDS, ddp_models):
        ddp = anchor_steps.build_ddp(model, kind, device)
        variants.append(Variant(kind, ddp, sgd(ddp)))
    variants.append(Variant(NO_COMM, plain, sgd(plain)))
    return variants, params, sample


# ---------------------------------------------------------------------------------------------- timing


def timed_block(v: Variant, data: torch.Tensor, target: torch.Tensor, n: int,
                device: torch.device) -> tuple[float, float]:
    """One variant's block of ``n`` steps from a settled start: (wall s, CPU s); gpucomm's counters kept."""
    anchor_steps.settle(device)
    anchor_steps.barrier(device)
    before = hvd.stats() if v.name == GPUCOMM else None
    out = anchor_steps.time_block(lambda: v.step(data, target), n, device)
    if before is not None:
        anchors.add_counts(v.counts, anchors.counter_delta(before, hvd.stats()))
    return out


def measure(name: str, variants: list[Variant], data: torch.Tensor, target: torch.Tensor,
            args: argparse.Namespace, device: torch.device, progress: Progress) -> dict[str, list[tuple[float, float]]]:
    """This rank's (wall, CPU) seconds per round for every variant. Every rank runs the same order: the
    collectives of gpucomm and DDP must meet."""
    by_name = {v.name: v for v in variants}
    orders = anchors.round_orders([v.name for v in variants], args.rounds)
    progress.show(f"{name}: warming up ({args.warmup} step{'' if args.warmup == 1 else 's'} each)", force=True)
    for v in (by_name[n] for n in orders[0]):
        for _ in range(args.warmup):
            v.step(data, target)
    seconds: dict[str, list[tuple[float, float]]] = {v.name: [] for v in variants}
    samples = args.batch_size * args.steps_per_round
    anchor_steps.freeze_heap()
    try:
        for r, order in enumerate(orders):
            for n in order:
                seconds[n].append(timed_block(by_name[n], data, target, args.steps_per_round, device))
            rates = ", ".join(f"{n} {samples / s[-1][0]:.1f}" for n, s in seconds.items())
            progress.show(f"{name}: round {r + 1}/{args.rounds}: {rates} samples/s on rank 0",
                          force=r + 1 == args.rounds)
    finally:
        anchor_steps.thaw_heap()
    return seconds


def job_seconds(local: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per round, the slowest rank's wall time (the job moves at its pace) and the ranks' mean CPU time."""
    every = hvd.allgather_object(local, name="train_seconds")
    wall = {v: [max(rank[v][r][0] for rank in every) for r in range(len(local[v]))] for v in local}
    cpu = {v: [sum(rank[v][r][1] for rank in every) / len(every) for r in range(len(local[v]))] for v in local}
    return wall, cpu


def spread(values: list[float]) -> dict[str, Any]:
    """Median, quartiles (inclusive: inside the range even for 2 rounds) and range; --rounds >= 2."""
    return bench_stats.spread(values)


def _ratio_record(num: list[float], den: list[float]) -> dict[str, Any]:
    """Throughput ratio of the medians and the per-round ratios with their spread."""
    return {"throughput_ratio": bench_stats.ratio(bench_stats.median(num), bench_stats.median(den)),
            **anchors.paired_ratios(num, den)}


def variant_record(wall: list[float], cpu: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """One variant's JSON: samples/s per device (per round, median, quartiles, range) and per-step wall
    and CPU seconds (median and quartiles of the rounds)."""
    samples, k = args.batch_size * args.steps_per_round, args.steps_per_round
    per_round = [samples / s for s in wall]
    rate, step, host = spread(per_round), spread([s / k for s in wall]), spread([c / k for c in cpu])
    return {"samples_per_s_per_device": rate["median"], "samples_per_s_total": rate["median"] * hvd.size(),
            "per_device_quartiles": rate["quartiles"], "per_device_range": rate["range"],
            "round_samples_per_s_per_device": per_round, "round_seconds": wall, "round_cpu_seconds": cpu,
            "wall_s_per_step": step["median"], "wall_quartiles": step["quartiles"],
            "cpu_s_per_step": host["median"], "cpu_quartiles": host["quartiles"]}


def summarize(wall: dict[str, list[float]], cpu: dict[str, list[float]], params: int, sample: tuple[int, ...],
              args: argparse.Namespace, baseline: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """The JSON record of one model: each variant's throughput and step times, its ratios to both DDP
    anchors and to the floor (round by round), what it adds over the floor, and scaling efficiency."""
    size, k = hvd.size(), args.steps_per_round
    variants = {v: variant_record(wall[v], cpu[v], args) for v in wall}
    rates = {v: r["round_samples_per_s_per_device"] for v, r in variants.items()}
    ratios = {f"vs_{a.replace('-', '_')}": {v: _ratio_record(rates[v], rates[a]) for v in rates}
              for a in (*DDP_KINDS, NO_COMM)}
    per_step = {v: [s / k for s in wall[v]] for v in wall}
    cpu_step = {v: [c / k for c in cpu[v]] for v in cpu}
    added = {"wall_s": anchors.added_over_floor(per_step), "cpu_s": anchors.added_over_floor(cpu_step)}
    added["gpucomm_vs_ddp_best"] = {key: anchors.added_ratio(added[key]) for key in ("wall_s", "cpu_s")}
    added["target"] = anchors.TARGET_ADDED_RATIO
    out: dict[str, Any] = {
        "parameters": params, "sample_shape": list(sample), "variants": variants, "ratios": ratios,
        "ratio_gpucomm_vs_ddp_best": ratios["vs_ddp_best"][GPUCOMM],
        "ratio_gpucomm_vs_ddp_default": ratios["vs_ddp_default"][GPUCOMM],
        "vs_no_comm": {v: r["throughput_ratio"] for v, r in ratios["vs_no_comm"].items() if v != NO_COMM},
        "added_over_floor": added, "scaling_efficiency": None}
    if baseline is not None:
        one = baseline["models"][name]["variants"]
        out["scaling_efficiency"] = {v: variants[v]["samples_per_s_total"] / (size * one[v]["samples_per_s_per_device"])
                                     for v in variants}
    return out


# ---------------------------------------------------------------------------------------------- output


class Progress:
    """Rank 0's running status: one rewritten line on a terminal, a plain line every ``interval`` s
    otherwise (under gpucomm-run stdout is a pipe, so each line gets its rank prefix). Silent elsewhere."""

    def __init__(self, enabled: bool, interval: float, stream: TextIO = sys.stdout) -> None:
        self.enabled, self.interval, self.stream = enabled, interval, stream
        self.tty = enabled and stream.isatty()
        self.last = -float("inf")

    def show(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(f"\r{text}\x1b[K")
            self.stream.flush()
            return
        now = time.monotonic()
        if force or now - self.last >= self.interval:
            print(f"progress: {text}", file=self.stream, flush=True)
            self.last = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return _cell(None if seconds is None else seconds * 1e3, ".2f")


def _row(name: str, v: str, r: dict[str, Any], m: dict[str, Any], label: str) -> str:
    q = r["per_device_quartiles"]
    eff = (m["scaling_efficiency"] or {}).get(v)
    vs = [m["ratios"][key][v]["throughput_ratio"] for key in ("vs_ddp_best", "vs_ddp_default", "vs_no_comm")]
    return (f"{name:12s} {label:20s} {r['samples_per_s_per_device']:16.1f} {r['samples_per_s_total']:15.1f} "
            f"{f'{q[0]:.1f}-{q[1]:.1f}':>17s} {_ms(r['wall_s_per_step']):>8s} {_ms(r['cpu_s_per_step']):>8s} "
            f"{_cell(vs[0], '.3f'):>8s} {_cell(vs[1], '.3f'):>8s} {_cell(vs[2], '.3f'):>8s} "
            f"{_cell(None if eff is None else 100 * eff, '11.1f'):>11s}{'%' if eff is not None else ''}")


def _ratio_line(name: str, label: str, anchor: str, r: dict[str, Any]) -> str:
    return (f"throughput, {name}: {label} / {anchor} {_cell(r['throughput_ratio'], '.3f')} (per-round ratios: median "
            f"{_cell(r['median'], '.3f')}, quartiles {bench_stats.fmt_pair(r['quartiles'], '.3f')}, "
            f"range {bench_stats.fmt_pair(r['range'], '.3f')})")


def _added_line(name: str, m: dict[str, Any], labels: dict[str, str]) -> str:
    added = m["added_over_floor"]
    parts = [f"{labels[v]} {_ms(w['median'])} / {_ms(added['cpu_s'][v]['median'])}" for v, w in added["wall_s"].items()]
    share = added["gpucomm_vs_ddp_best"]
    return (f"added over no-comm, {name}, wall / CPU ms per step: " + "; ".join(parts)
            + f"; gpucomm / ddp-best added: {_cell(share['wall_s'], '.2f')} wall, {_cell(share['cpu_s'], '.2f')} CPU "
              f"(target <= {added['target']})")


def table(result: dict[str, Any]) -> list[str]:
    """The final report: one line per model and variant, then the ratios and the added costs per model."""
    n = result["threads_per_rank"]
    labels = result["labels"]
    threads = f" ({n} thread{'s' if n > 1 else ''} each)" if result["device"] == "cpu" else ""
    lines = [f"{', '.join(result['models'])} on {result['ranks']} {result['device'].upper()} rank(s){threads}; "
             f"batch {result['batch_size']} per rank; {result['rounds']} interleaved rounds of "
             f"{result['steps_per_round']} step{'' if result['steps_per_round'] == 1 else 's'} after "
             f"{result['warmup']} warm-up step{'' if result['warmup'] == 1 else 's'} per variant",
             anchors.socket_text(result["nccl_sockets"]),
             f"{'model':12s} {'variant':20s} {'samples/s/device':>16s} {'total samples/s':>15s} "
             f"{'IQR per device':>17s} {'ms/step':>8s} {'CPU ms':>8s} {'vs best':>8s} {'vs dflt':>8s} "
             f"{'vs floor':>8s} {'scaling eff.':>12s}"]
    for name, m in result["models"].items():
        lines += [_row(name, v, r, m, labels[v]) for v, r in m["variants"].items()]
    for name, m in result["models"].items():
        lines.append(_ratio_line(name, labels[GPUCOMM], "DDP-best", m["ratio_gpucomm_vs_ddp_best"]))
        lines.append(_ratio_line(name, labels[GPUCOMM], "DDP-default", m["ratio_gpucomm_vs_ddp_default"]))
        lines.append(_added_line(name, m, labels))
    reducer = anchors.reducer_line(result["one_rank_reducer"])
    lines += [reducer] if reducer else []
    lines += [f"note: {n}" for n in result["notes"]]
    if result["ranks"] == 1:
        lines.append("1-rank run: pass its JSON as --baseline to an N-rank run with the same flags "
                     "for scaling efficiency")
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    """Total samples/s of each variant per model (bars with the per-round quartiles), and scaling
    efficiency per model when a baseline was given."""
    import matplotlib  # noqa: PLC0415  (optional dependency, checked in parse_args)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(result["models"])
    with_eff = result["baseline"] is not None
    fig, axes = plt.subplots(1, len(names) + with_eff, figsize=(4.8 * (len(names) + with_eff), 4), squeeze=False)
    colors = {GPUCOMM: "tab:blue", DDP_DEFAULT: "tab:orange", DDP_BEST: "tab:red", NO_COMM: "tab:gray"}
    size = result["ranks"]
    for ax, name in zip(axes[0], names):
        m = result["models"][name]
        vs = list(m["variants"])
        mids = [m["variants"][v]["samples_per_s_total"] for v in vs]
        lo = [mid - size * m["variants"][v]["per_device_quartiles"][0] for mid, v in zip(mids, vs)]
        hi = [size * m["variants"][v]["per_device_quartiles"][1] - mid for mid, v in zip(mids, vs)]
        ax.bar(vs, mids, yerr=[[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]], capsize=4,
               color=[colors[v] for v in vs])
        ax.set_title(f"{name}: gpucomm/ddp-best {_cell(m['ratio_gpucomm_vs_ddp_best']['throughput_ratio'], '.3f')}")
        ax.set_ylabel(f"samples/s, {size} rank(s) total")
        ax.tick_params(axis="x", labelsize=8)
    if with_eff:
        ax = axes[0][-1]
        width = 0.8 / len(VARIANTS)
        for i, v in enumerate(VARIANTS):
            xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [100 * result["models"][n]["scaling_efficiency"][v] for n in names], width, label=v,
                   color=colors[v])
        ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"scaling efficiency at {size} ranks (%)")
        ax.set_title("vs the 1-rank baseline")
        ax.legend(fontsize="small")
    fig.suptitle(f"synthetic training, {size} {result['device'].upper()} rank(s), "
                 f"batch {result['batch_size']} per rank "
                 "(bars: median of the rounds; whiskers: their quartiles)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def run_model(name: str, args: argparse.Namespace, device: torch.device, baseline: dict[str, Any] | None,
              progress: Progress, counts: dict[str, int]) -> dict[str, Any]:
    variants, params, sample = build_variants(name, device)
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g).to(device)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
    wall, cpu = job_seconds(measure(name, variants, data, target, args, device, progress))
    anchors.add_counts(counts, variants[0].counts)
    del variants
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize(wall, cpu, params, sample, args, baseline, name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"train.py: error: --device cuda: torch sees no CUDA GPU (torch {torch.__version__}); use --device cpu "
              "or run on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
    sockets = anchors.tune_sockets()
    anchors.ask_one_rank_reducer(args.one_rank_reducer == "on")
    hvd.init()
    device = pick_device(args.device)
    names = args.models or default_models(device, args.quick)
    baseline = agreed_baseline(args, device, names)
    store = init_torch_group("nccl" if device.type == "cuda" else "gloo")
    progress = Progress(hvd.rank() == 0, args.progress_interval)
    result: dict[str, Any] = {
        "benchmark": "train", "ranks": hvd.size(), "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads_per_rank": torch.get_num_threads(), "batch_size": args.batch_size, "warmup": args.warmup,
        "rounds": args.rounds, "steps_per_round": args.steps_per_round, "quick": args.quick,
        "torch": torch.__version__, "gpucomm": gpucomm.__version__, "baseline": args.baseline,
        "round_orders": anchors.round_orders(list(VARIANTS), args.rounds),
        "ddp_options": {k: anchor_steps.ddp_keywords(k) for k in DDP_KINDS}, "nccl_sockets": sockets,
        "notes": baseline_notes(baseline, device), "models": {}}
    balance = anchors.balance_note(len(VARIANTS), args.rounds)
    result["notes"] += [balance] if balance else []
    counts: dict[str, int] = {}
    for name in names:
        result["models"][name] = run_model(name, args, device, baseline, progress, counts)
    result["one_rank_reducer"] = anchors.reducer_record(hvd.size(), args.one_rank_reducer == "on", counts)
    result["labels"] = {v: v for v in VARIANTS}
    result["labels"][GPUCOMM] = anchors.gpucomm_label(hvd.size(), bool(result["one_rank_reducer"]["verified"]))
    progress.close()
    if hvd.rank() == 0:
        print("\n".join(table(result)))
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
        if args.plot:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
    dist.destroy_process_group()
    del store
    hvd.shutdown()


if __name__ == "__main__":
    main()
