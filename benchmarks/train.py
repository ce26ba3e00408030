"""Synthetic training throughput: gpucomm's DistributedOptimizer beside PyTorch DDP in the same job.

For each model, identical copies train on the same random batches: one wrapped by
``hvd.DistributedOptimizer``, one by DDP (NCCL for CUDA tensors, Gloo for CPU tensors, on its own
process group) and, at 1 rank only, a plain copy with no wrapper, so that gpucomm's single-device
overhead shows. After a warm-up, rounds of K steps rotate the order (gpucomm, DDP, ...; then DDP,
gpucomm, ...) so machine noise hits every variant alike. A round is timed with CUDA events on GPUs
and ``perf_counter`` on CPUs; the job's time for a round is its slowest rank's.

    gpucomm-run -np 2 python benchmarks/train.py --device cpu --quick        # under a minute on 2 cores
    gpucomm-run -np 4 python benchmarks/train.py                            # one GPU per rank
    gpucomm-run -np 2 --single-gpu-test python benchmarks/train.py          # two ranks, one GPU (slow: loopback)

Models: ``resnet50`` when torchvision is installed, otherwise the built-in ``cnn`` and ``transformer``
(``--models`` chooses; ``--quick`` on CPU defaults to ``cnn,transformer``). Throughput is in samples/s
(images/s for the image models), per device and for the whole job.

Scaling efficiency needs the 1-rank number from a 1-rank run (N ranks on N devices do not tell it).
A verification run therefore chains two jobs with the same flags; the first one's JSON is the baseline:

    gpucomm-run -np 1 python benchmarks/train.py --json train_1.json
    gpucomm-run -np 8 python benchmarks/train.py --baseline train_1.json --json train_8.json --plot train_8.png

efficiency = total samples/s at N ranks / (N x samples/s at 1 rank), for each variant against the same
variant at 1 rank (gpucomm against gpucomm, DDP against DDP). The baseline must have the same device
kind, batch size and models; anything else is refused with the difference named.

On CPUs each rank uses ``OMP_NUM_THREADS`` threads when that is set, else the host's cores divided by
its ranks; set it to compare a 1-rank baseline and an N-rank run at the same threads per rank.

Rank 0 shows progress (one updating line on a terminal, a plain line every few seconds otherwise),
prints a table, writes JSON (``--json``) and, with ``--plot``, a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from torch_group import init_torch_group  # noqa: E402
import bench_stats  # noqa: E402

import gpucomm  # noqa: E402
import gpucomm.torch as hvd  # noqa: E402

GPUCOMM, DDP, PLAIN = "gpucomm", "ddp", "plain"
# (batch per rank, warm-up steps per variant, rounds, steps per round)
FULL = (32, 5, 10, 10)
QUICK = (8, 2, 6, 3)


@dataclass
class Variant:
    """One copy of the model with its optimizer; ``step()`` trains it on one batch."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

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
    ap.add_argument("--baseline", metavar="JSON", help="a 1-rank run's JSON: report scaling efficiency against it")
    ap.add_argument("--json", default="train_bench.json", metavar="PATH", help="results (default %(default)s)")
    ap.add_argument("--plot", metavar="PNG", help="also draw throughput (and scaling efficiency) to this PNG")
    ap.add_argument("--progress-interval", type=float, default=5.0, metavar="S",
                    help="seconds between progress lines when stdout is not a terminal (default %(default)s)")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for field, default in zip(("batch_size", "warmup", "rounds", "steps_per_round"), defaults):
        if getattr(args, field) is None:
            setattr(args, field, default)
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
        missing = [v for v in (GPUCOMM, DDP) if not _positive_rate(theirs, v)]
        if missing:
            raise SystemExit(f"--baseline {path}: its {name!r} has no samples/s for {', '.join(missing)} "
                             "(a partial or hand-edited file); make it again with gpucomm-run -np 1")
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


def no_buffer_sync() -> dict[str, bool]:
    """DDP's keyword that turns off its per-forward buffer broadcast: gpucomm, like Horovod, leaves
    BatchNorm buffers per rank, so both then move the same bytes (the gradients) and nothing else.
    Newer torch renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and warns about the old name."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def baseline_notes(baseline: dict[str, Any] | None, device: torch.device) -> list[str]:
    """Caveats on the efficiency numbers: on CPUs, ranks share the cores, so a 1-rank baseline that
    ran with more threads per rank mixes thread scaling into rank scaling."""
    if baseline is None or device.type != "cpu" or baseline.get("threads_per_rank") == torch.get_num_threads():
        return []
    return [f"the baseline ran {baseline.get('threads_per_rank')} threads per rank, this run "
            f"{torch.get_num_threads()}: CPU scaling efficiency includes that difference"]


def build_variants(name: str, device: torch.device) -> tuple[list[Variant], int, tuple[int, ...]]:
    """Identical copies of ``name`` (same seed on every rank): gpucomm, DDP and, at 1 rank, plain."""
    torch.manual_seed(0)
    base, sample = models.build(name)
    params = sum(p.numel() for p in base.parameters())

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    ours = copy.deepcopy(base).to(device)
    ours_opt = hvd.DistributedOptimizer(sgd(ours), named_parameters=ours.named_parameters())
    hvd.broadcast_parameters(ours.state_dict(), root_rank=0)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device), **no_buffer_sync(),
                                                       device_ids=[device.index] if device.type == "cuda" else None)
    variants = [Variant(GPUCOMM, ours, ours_opt), Variant(DDP, theirs, sgd(theirs))]
    if hvd.size() == 1:
        plain = copy.deepcopy(base).to(device)
        variants.append(Variant(PLAIN, plain, sgd(plain)))
    return variants, params, sample


# ---------------------------------------------------------------------------------------------- timing


def timed(step: Callable[[], None], n: int, device: torch.device) -> float:
    """Seconds for ``n`` calls of ``step``: CUDA events on a GPU (queued work included), else wall time."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)  # nothing of the previous variant may run inside this one's interval
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(name: str, variants: list[Variant], data: torch.Tensor, target: torch.Tensor,
            args: argparse.Namespace, device: torch.device, progress: Progress) -> dict[str, list[float]]:
    """This rank's seconds per round for every variant. Every rank runs the same order: the collectives
    of gpucomm and DDP must meet."""
    steppers = {v.name: (lambda v=v: v.step(data, target)) for v in variants}
    progress.show(f"{name}: warming up ({args.warmup} steps each)", force=True)
    for v in variants:
        timed(steppers[v.name], args.warmup, device)
    seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    samples = args.batch_size * args.steps_per_round
    for r in range(args.rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            seconds[v.name].append(timed(steppers[v.name], args.steps_per_round, device))
        rates = ", ".join(f"{n} {samples / s[-1]:.1f}" for n, s in seconds.items())
        progress.show(f"{name}: round {r + 1}/{args.rounds}: {rates} samples/s on rank 0",
                      force=r + 1 == args.rounds)
    return seconds


def job_seconds(local: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per round, the slowest rank's time: the job moves at that pace."""
    every = hvd.allgather_object(local, name="train_seconds")
    return {v: [max(rank[v][r] for rank in every) for r in range(len(local[v]))] for v in local}


def spread(values: list[float]) -> dict[str, Any]:
    """Median, quartiles (inclusive: inside the range even for 2 rounds) and range; --rounds >= 2."""
    return bench_stats.spread(values)


def summarize(seconds: dict[str, list[float]], params: int, sample: tuple[int, ...], args: argparse.Namespace,
              baseline: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """The JSON record of one model: throughput of each variant, gpucomm / DDP, overheads, efficiency."""
    size, samples = hvd.size(), args.batch_size * args.steps_per_round
    rates = {v: [samples / s for s in secs] for v, secs in seconds.items()}
    variants = {}
    for v, per_round in rates.items():
        s = spread(per_round)
        variants[v] = {"samples_per_s_per_device": s["median"], "samples_per_s_total": s["median"] * size,
                       "per_device_quartiles": s["quartiles"], "per_device_range": s["range"],
                       "round_samples_per_s_per_device": per_round, "round_seconds": seconds[v]}
    ratios = [g / d for g, d in zip(rates[GPUCOMM], rates[DDP])]
    out: dict[str, Any] = {
        "parameters": params, "sample_shape": list(sample), "variants": variants,
        "ratio_gpucomm_vs_ddp": {"throughput_ratio": variants[GPUCOMM]["samples_per_s_per_device"]
                                 / variants[DDP]["samples_per_s_per_device"], "round_ratios": ratios, **spread(ratios)},
        "overhead_vs_plain": None, "scaling_efficiency": None}
    if PLAIN in variants:
        plain = variants[PLAIN]["samples_per_s_per_device"]
        out["overhead_vs_plain"] = {v: variants[v]["samples_per_s_per_device"] / plain for v in (GPUCOMM, DDP)}
    if baseline is not None:
        one = baseline["models"][name]["variants"]
        out["scaling_efficiency"] = {v: variants[v]["samples_per_s_total"] / (size * one[v]["samples_per_s_per_device"])
                                     for v in (GPUCOMM, DDP)}
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


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: dict[str, Any]) -> list[str]:
    """The final report: one line per model and variant, then the gpucomm / DDP ratio of each model."""
    n = result["threads_per_rank"]
    threads = f" ({n} thread{'s' if n > 1 else ''} each)" if result["device"] == "cpu" else ""
    lines = [f"{', '.join(result['models'])} on {result['ranks']} {result['device'].upper()} rank(s){threads}; "
             f"batch {result['batch_size']} per rank; {result['rounds']} interleaved rounds of "
             f"{result['steps_per_round']} steps after {result['warmup']} warm-up steps per variant",
             f"{'model':12s} {'variant':8s} {'samples/s/device':>16s} {'total samples/s':>15s} "
             f"{'IQR per device':>17s} {'vs DDP':>7s} {'vs plain':>8s} {'scaling eff.':>12s}"]
    for name, m in result["models"].items():
        ddp = m["variants"][DDP]["samples_per_s_per_device"]
        for v, r in m["variants"].items():
            q = r["per_device_quartiles"]
            over = (m["overhead_vs_plain"] or {}).get(v)
            eff = (m["scaling_efficiency"] or {}).get(v)
            lines.append(f"{name:12s} {v:8s} {r['samples_per_s_per_device']:16.1f} {r['samples_per_s_total']:15.1f} "
                         f"{f'{q[0]:.1f}-{q[1]:.1f}':>17s} {r['samples_per_s_per_device'] / ddp:7.3f} "
                         f"{_cell(over, '8.3f'):>8s} {_cell(None if eff is None else 100 * eff, '11.1f'):>11s}"
                         f"{'%' if eff is not None else ''}")
    for name, m in result["models"].items():
        r = m["ratio_gpucomm_vs_ddp"]
        lines.append(f"gpucomm / DDP throughput, {name}: {r['throughput_ratio']:.3f} (per-round ratios: median "
                     f"{r['median']:.3f}, quartiles {r['quartiles'][0]:.3f}-{r['quartiles'][1]:.3f}, "
                     f"range {r['range'][0]:.3f}-{r['range'][1]:.3f})")
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
    fig, axes = plt.subplots(1, len(names) + with_eff, figsize=(4.2 * (len(names) + with_eff), 4), squeeze=False)
    colors = {GPUCOMM: "tab:blue", DDP: "tab:orange", PLAIN: "tab:gray"}
    size = result["ranks"]
    for ax, name in zip(axes[0], names):
        m = result["models"][name]
        vs = list(m["variants"])
        mids = [m["variants"][v]["samples_per_s_total"] for v in vs]
        lo = [mid - size * m["variants"][v]["per_device_quartiles"][0] for mid, v in zip(mids, vs)]
        hi = [size * m["variants"][v]["per_device_quartiles"][1] - mid for mid, v in zip(mids, vs)]
        ax.bar(vs, mids, yerr=[[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]], capsize=4,
               color=[colors[v] for v in vs])
        ax.set_title(f"{name}: gpucomm/DDP {m['ratio_gpucomm_vs_ddp']['throughput_ratio']:.3f}")
        ax.set_ylabel(f"samples/s, {size} rank(s) total")
    if with_eff:
        ax = axes[0][-1]
        width = 0.38
        for i, v in enumerate((GPUCOMM, DDP)):
            xs = [j + (i - 0.5) * width for j in range(len(names))]
            ax.bar(xs, [100 * result["models"][n]["scaling_efficiency"][v] for n in names], width, label=v,
                   color=colors[v])
        ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"scaling efficiency at {size} ranks (%)")
        ax.set_title("vs the 1-rank baseline")
        ax.legend()
    fig.suptitle(f"synthetic training, {size} {result['device'].upper()} rank(s), "
                 f"batch {result['batch_size']} per rank "
                 "(bars: median of the rounds; whiskers: their quartiles)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def run_model(name: str, args: argparse.Namespace, device: torch.device, baseline: dict[str, Any] | None,
              progress: Progress) -> dict[str, Any]:
    variants, params, sample = build_variants(name, device)
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g).to(device)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
    seconds = job_seconds(measure(name, variants, data, target, args, device, progress))
    del variants
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize(seconds, params, sample, args, baseline, name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"train.py: error: --device cuda: torch sees no CUDA GPU (torch {torch.__version__}); use --device cpu "
              "or run on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
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
        "notes": baseline_notes(baseline, device), "models": {}}
    for name in names:
        result["models"][name] = run_model(name, args, device, baseline, progress)
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
