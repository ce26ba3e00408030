"""What recording a timeline costs a training step, and what the timeline shows: DistributedOptimizer
training on CPU ranks with the timeline off and on, then the overlap of bucket allreduces with backward.

    gpucomm-run -np 2 python benchmarks/timeline_overhead.py [--out DIR]

One model, one optimizer, one fixed batch per rank. After a warm-up, ``--pairs`` pairs of blocks of
``--steps-per-block`` steps alternate between the timeline off and on (off/on, then on/off, so
neither always goes first); an "on" block is wrapped in ``hvd.start_timeline(DIR/timeline.<k>.json)``
/ ``hvd.stop_timeline()`` (rank 0 records; the calls themselves are outside the timed steps). A step
is zero_grad, forward, loss, backward, ``optimizer.step()``; its time is the slowest rank's.

The last timeline is drawn to ``DIR/timeline.png`` (and its last step to ``DIR/timeline_step.png``)
with ``gpucomm.timeline.plot.render``. From every timeline, with ``gpucomm.timeline.plot``:

* ``overlap_ms("DistributedOptimizer.backward", ("DistributedOptimizer.bucket.*", "GLOO_ALLREDUCE"))``:
  how long a bucket allreduce ran while backward was still producing gradients;
* ``busy_ms`` of the bucket allreduces, and the hidden fraction overlap / busy;
* per bucket: its bytes, its path (``GLOO_ALLREDUCE``, or ``COORDINATOR_REDUCE`` for a bucket small
  enough for the coordinator to reduce inline), its median negotiation time (rank 0's request to the
  last rank's: how far the ranks drift apart) and when its allreduce started relative to the end of
  its step's backward (negative: during backward).

Models: ``convnet`` (default): four 3x3 convolutions and a two-layer head on 3x64x64 images, 1000
classes, 0.9 M parameters; its head (the last layer, 1.03 MB) fits gpucomm's 1 MiB first bucket, so
with the default fusion limits it has two buckets, the head's launched early in backward. ``cnn`` is
examples/models.py's small CNN: 0.89 MB, a single bucket, launched when the last gradient arrives,
so nothing can overlap backward. ``--fusion-threshold`` sets GPUCOMM_FUSION_THRESHOLD (bucket cap,
bytes) on every rank before the optimizer is built.

Rank 0 prints a table and writes ``DIR/timeline_overhead.json``. ``--quick`` is a smoke run (one
pair of 2-step blocks after 1 warm-up step, batch 8). At 1 rank DistributedOptimizer reduces nothing,
so the timeline has no bucket spans: the overhead is still measured, the overlap reads n/a with that
reason. A timeline that cannot be read is reported as not analysed instead of stopping the run;
without matplotlib the PNGs are skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402

import gpucomm  # noqa: E402
import gpucomm.torch as hvd  # noqa: E402
from gpucomm.timeline import plot as timeline_plot  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import fmt, fmt_pair, quartiles, ratio, write_json  # noqa: E402

QUICK = {"pairs": 1, "steps_per_block": 2, "warmup": 1, "batch_size": 8}
FULL = {"pairs": 8, "steps_per_block": 5, "warmup": 3, "batch_size": 32}
BACKWARD = "DistributedOptimizer.backward"
BUCKETS = "DistributedOptimizer.bucket.*"
GLOO = (BUCKETS, "GLOO_ALLREDUCE")
INLINE = (BUCKETS, "COORDINATOR_REDUCE")


def convnet(num_classes: int = 1000) -> nn.Module:
    """Conv net whose backward is mostly convolution: the head's gradients come first and fill
    bucket 0 (1.03 MB <= the 1 MiB first bucket), the convolutions' fill bucket 1."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, num_classes))


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    return (convnet(), (3, 64, 64)) if name == "convnet" else models.build(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--model", choices=["convnet", "cnn"], default="convnet", help="(default %(default)s)")
    ap.add_argument("--batch-size", type=int, help=f"samples per rank and step (default {FULL['batch_size']})")
    ap.add_argument("--warmup", type=int, help=f"untimed steps first (default {FULL['warmup']})")
    ap.add_argument("--pairs", type=int, help=f"off/on block pairs (default {FULL['pairs']})")
    ap.add_argument("--steps-per-block", type=int, help=f"(default {FULL['steps_per_block']})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    ap.add_argument("--fusion-threshold", type=int, metavar="BYTES",
                    help="bucket cap (GPUCOMM_FUSION_THRESHOLD) for this run; default: gpucomm's (25 MiB, first 1 MiB)")
    ap.add_argument("--out", default="timeline_overhead", metavar="DIR",
                    help="timelines, PNGs and timeline_overhead.json go here (default %(default)s)")
    ap.add_argument("--no-png", action="store_true", help="skip drawing (matplotlib missing)")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.batch_size, args.pairs, args.steps_per_block) < 1 or args.warmup < 0:
        ap.error("--batch-size, --pairs and --steps-per-block must be positive, --warmup not negative")
    if args.fusion_threshold is not None and args.fusion_threshold < 0:
        ap.error("--fusion-threshold must not be negative")
    return args


# ---------------------------------------------------------------------------------------------- analysis


def bucket_report(trace: timeline_plot.Trace, bucket_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """Per bucket: path taken, and when its reduction started relative to its step's last gradient."""
    steps = sorted((s.start_us, s.end_us) for s in timeline_plot.select_spans(trace, BACKWARD))
    out = []
    for name, nbytes in bucket_bytes.items():
        gloo = timeline_plot.select_spans(trace, (name, "GLOO_ALLREDUCE"))
        inline = timeline_plot.select_spans(trace, (name, "COORDINATOR_REDUCE"))
        negotiate = [(s.end_us - s.start_us) / 1000.0
                     for s in timeline_plot.select_spans(trace, (name, "NEGOTIATE_*"))]
        starts = []
        for s in gloo + inline:
            mine = [b for b in steps if b[0] <= s.start_us]
            if mine:
                starts.append((s.start_us - mine[-1][1]) / 1000.0)
        out.append({"bucket": name, "bytes": nbytes,
                    "path": "GLOO_ALLREDUCE" if gloo else "COORDINATOR_REDUCE" if inline else "none",
                    "reductions": len(gloo) + len(inline),
                    "allreduce_ms_median": statistics.median([(s.end_us - s.start_us) / 1000.0 for s in gloo])
                    if gloo else None,
                    "negotiate_ms_median": statistics.median(negotiate) if negotiate else None,
                    "start_minus_backward_end_ms_median": statistics.median(starts) if starts else None})
    return out


def analyse(path: str, bucket_bytes: dict[str, int]) -> dict[str, Any]:
    trace = timeline_plot.load_trace(path)
    backward = timeline_plot.busy_ms(trace, BACKWARD)
    allreduce = timeline_plot.busy_ms(trace, GLOO)
    overlap = timeline_plot.overlap_ms(trace, BACKWARD, GLOO)
    return {"timeline": path, "steps": len(timeline_plot.select_spans(trace, BACKWARD)),
            "backward_ms": backward, "gloo_allreduce_busy_ms": allreduce, "overlap_ms": overlap,
            "hidden_fraction": overlap / allreduce if allreduce > 0 else None,
            "inline_bucket_reductions": len(timeline_plot.select_spans(trace, INLINE)),
            # spans the file ends inside: another rank's next request (here the final allgather) can reach
            # the coordinator before rank 0 stops the timeline; the optimizer's own rows must be complete
            "open_spans": trace.open_spans,
            "open_optimizer_spans": sum(not s.closed
                                        for s in timeline_plot.select_spans(trace, "DistributedOptimizer.*")),
            "buckets": bucket_report(trace, bucket_bytes)}


def diagnosis(last: dict[str, Any]) -> list[str]:
    """Why the hidden fraction is what it is, in words, from the per-bucket report."""
    notes = []
    buckets = last["buckets"]
    if len(buckets) == 1:
        notes.append("one bucket: it is complete only when the last gradient arrives, so its allreduce starts "
                     "when backward ends and nothing can overlap (use a model with more gradient bytes than the "
                     "first bucket, or a lower --fusion-threshold)")
    for b in buckets:
        if b["path"] == "COORDINATOR_REDUCE":
            notes.append(f"{b['bucket']} ({b['bytes']} B) is at most GPUCOMM_INLINE_BYTES: the coordinator reduces "
                         "it inline, so it has no GLOO_ALLREDUCE span to overlap anything")
        elif len(buckets) > 1 and b["start_minus_backward_end_ms_median"] is not None \
                and b["start_minus_backward_end_ms_median"] >= 0:
            notes.append(f"{b['bucket']} ({b['bytes']} B) holds the first layers, whose gradients come last: it "
                         f"can only start after backward (median {b['start_minus_backward_end_ms_median']:.2f} ms "
                         f"after rank 0's last gradient)")
    for b in buckets:
        if b["negotiate_ms_median"] is not None and b["negotiate_ms_median"] >= 1.0:
            notes.append(f"{b['bucket']}: negotiation median {b['negotiate_ms_median']:.2f} ms, from the first "
                         "rank's request to the last rank's: the ranks reach that gradient that far apart")
    if last["hidden_fraction"] is not None and last["hidden_fraction"] < 0.05:
        notes.append("overlap is near zero: see the bucket lines above")
    return notes


def bucket_plan(optimizer: Any) -> dict[str, int]:
    """Bucket name -> bytes from the optimizer's plan, for the report. There is no public accessor: this
    reads ``DistributedOptimizer._buckets`` (a list of buckets, or an object holding them in ``.buckets``)
    and answers {} when this gpucomm keeps them some other way."""
    held = getattr(optimizer, "_buckets", None)
    held = getattr(held, "buckets", held)
    try:
        return {f"DistributedOptimizer.bucket.{b.plan.index}": b.plan.numel * b.plan.dtype.itemsize for b in held}
    except (TypeError, AttributeError):
        return {}


def safe_analyse(path: str, bucket_bytes: dict[str, int]) -> dict[str, Any]:
    """``analyse``, or ``{"timeline": path, "error": why}`` when the file cannot be read as a timeline."""
    try:
        return analyse(path, bucket_bytes)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"timeline": path, "error": f"{type(e).__name__}: {e}"}


def overlap_notes(ranks: int, analyses: list[dict[str, Any]]) -> list[str]:
    """Why there is no overlap figure, when there is none."""
    good = [a for a in analyses if "error" not in a]
    if not good:
        return [f"no timeline could be analysed ({analyses[-1]['error'] if analyses else 'none recorded'})"]
    if ranks == 1:
        return ["at 1 rank DistributedOptimizer reduces nothing, so the timeline has no bucket spans: overlap n/a "
                "(run 2 or more ranks to measure it)"]
    if not good[-1]["buckets"]:
        return ["per-bucket figures n/a: the optimizer's bucket plan could not be read (DistributedOptimizer."
                "_buckets changed shape); overlap and busy time above still hold"]
    return diagnosis(good[-1])


def summarize(times: dict[str, list[float]], every: list[dict[str, list[float]]], steps_per_block: int
              ) -> dict[str, Any]:
    """Step times of the slowest rank: medians, quartiles, overhead and per-pair block ratios."""
    job = {m: [max(r[m][i] for r in every) for i in range(len(times[m]))] for m in times}
    blocks = {m: [statistics.median(job[m][i:i + steps_per_block]) for i in range(0, len(job[m]), steps_per_block)]
              for m in job}
    off, on = statistics.median(job["off"]), statistics.median(job["on"])
    pair_ratios = [r for r in (ratio(b, a) for a, b in zip(blocks["off"], blocks["on"])) if r is not None]
    overhead = ratio(on, off)
    return {"steps_per_mode": len(job["off"]),
            "step_ms": {"off_median": off * 1e3, "on_median": on * 1e3,
                        "off_quartiles": scale_pair(quartiles(job["off"]), 1e3),
                        "on_quartiles": scale_pair(quartiles(job["on"]), 1e3)},
            "overhead_pct": None if overhead is None else (overhead - 1) * 100,
            "pair_ratio_median": statistics.median(pair_ratios) if pair_ratios else None,
            "pair_ratios": pair_ratios}


def scale_pair(pair: list[float] | None, factor: float) -> list[float] | None:
    return None if pair is None else [x * factor for x in pair]


def draw(result: dict[str, Any], last: dict[str, Any] | None, args: argparse.Namespace, out_dir: str) -> None:
    """The last timeline, and its last step, as PNGs (skipped, with a note, when they cannot be drawn)."""
    if args.no_png:
        return
    if importlib.util.find_spec("matplotlib") is None:
        result["diagnosis"].append("PNGs skipped: matplotlib is not installed (pip install matplotlib)")
        return
    if last is None:
        return
    result["png"] = os.path.join(out_dir, "timeline.png")
    timeline_plot.render(last["timeline"], result["png"],
                         title=f"{args.model}, {hvd.size()} CPU ranks, batch {args.batch_size}: "
                               f"last timeline ({args.steps_per_block} steps)")
    trace = timeline_plot.load_trace(last["timeline"])
    backs = sorted(timeline_plot.select_spans(trace, BACKWARD), key=lambda s: s.start_us)
    if backs:
        t_end = trace.time_range_us()[1]
        lo = backs[-1].start_us - 0.2 * (backs[-1].end_us - backs[-1].start_us)
        result["png_step"] = os.path.join(out_dir, "timeline_step.png")
        timeline_plot.render(last["timeline"], result["png_step"], window_ms=(lo / 1e3, t_end / 1e3),
                             title=f"{args.model}: the last step of the last timeline")


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.fusion_threshold is not None:
        os.environ["GPUCOMM_FUSION_THRESHOLD"] = str(args.fusion_threshold)  # read when the optimizer plans buckets
    hvd.init()
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    out_dir = os.path.abspath(args.out)
    if hvd.rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    model, sample = build(args.model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    bucket_bytes = bucket_plan(optimizer)
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        return time.perf_counter() - t0

    load_before = os.getloadavg()  # other work on the machine shows in the step times: recorded beside them
    for _ in range(args.warmup):
        step()
    times: dict[str, list[float]] = {"off": [], "on": []}
    timelines = []
    for k in range(args.pairs):
        for mode in (("off", "on") if k % 2 == 0 else ("on", "off")):
            hvd.barrier()
            if mode == "on":
                timelines.append(os.path.join(out_dir, f"timeline.{k}.json"))
                hvd.start_timeline(timelines[-1])
            times[mode] += [step() for _ in range(args.steps_per_block)]
            if mode == "on":
                hvd.stop_timeline()  # rank 0 closes the file: complete JSON
    every = hvd.allgather_object(times, name="timeline_overhead.times")
    if hvd.rank() == 0:
        analyses = [safe_analyse(p, bucket_bytes) for p in timelines]
        good = [a for a in analyses if "error" not in a]
        last = good[-1] if good else None
        total_overlap = sum(a["overlap_ms"] for a in good)
        total_busy = sum(a["gloo_allreduce_busy_ms"] for a in good)
        result: dict[str, Any] = {
            "benchmark": "timeline_overhead", "ranks": hvd.size(), "model": args.model,
            "parameters": sum(p.numel() for p in model.parameters()), "batch_size": args.batch_size,
            "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__, "gpucomm": gpucomm.__version__,
            "fusion_threshold": os.environ.get("GPUCOMM_FUSION_THRESHOLD"), "buckets": bucket_bytes,
            "args": vars(args), "loadavg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
            **summarize(times, every, args.steps_per_block), "last_timeline": last,
            "unreadable_timelines": [a for a in analyses if "error" in a],
            "all_timelines": {"overlap_ms": total_overlap, "gloo_allreduce_busy_ms": total_busy,
                              "hidden_fraction": ratio(total_overlap, total_busy),
                              "hidden_fraction_per_timeline": [a["hidden_fraction"] for a in good]},
            "diagnosis": overlap_notes(hvd.size(), analyses), "png": None, "png_step": None}
        draw(result, last, args, out_dir)
        print("\n".join(table(result)))
        path = os.path.join(out_dir, "timeline_overhead.json")
        write_json(path, result)
        print(f"wrote {path}")
    hvd.barrier()
    hvd.shutdown()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(r: dict[str, Any]) -> list[str]:
    s, last = r["step_ms"], r["last_timeline"]
    sizes = ", ".join(f"{n.rsplit('.', 1)[-1]}: {b} B" for n, b in r["buckets"].items())
    lines = [f"# {r['model']} ({r['parameters']} parameters), {r['ranks']} CPU ranks x {r['threads_per_rank']} "
             f"thread(s), batch {r['batch_size']}; buckets {sizes}; {r['args']['pairs']} off/on pairs of "
             f"{r['args']['steps_per_block']} steps ({r['steps_per_mode']} steps per mode), slowest rank; load "
             f"average (1 min) {r['loadavg_1min']['before']:.2f} before, {r['loadavg_1min']['after']:.2f} after",
             f"{'timeline':>8} {'median step ms':>14} {'quartiles ms':>17}",
             f"{'off':>8} {s['off_median']:14.1f} {fmt_pair(s['off_quartiles'], '.1f', '-'):>17}",
             f"{'on':>8} {s['on_median']:14.1f} {fmt_pair(s['on_quartiles'], '.1f', '-'):>17}",
             f"timeline overhead: {fmt(r['overhead_pct'], '+.1f')}% (median step on / off - 1; median of per-pair "
             f"block ratios {fmt(r['pair_ratio_median'], '.3f')})"]
    lines += timeline_lines(last) if last else ["# last timeline: not analysed (see the notes)"]
    a = r["all_timelines"]
    lines.append(f"all {len(a['hidden_fraction_per_timeline'])} timelines: overlap {a['overlap_ms']:.1f} ms of "
                 f"{a['gloo_allreduce_busy_ms']:.1f} ms allreduce busy, hidden "
                 f"{_fmt(None if a['hidden_fraction'] is None else 100 * a['hidden_fraction'], '.1f')}%")
    lines += [f"note: {n}" for n in r["diagnosis"]]
    if r["png"]:
        lines.append(f"timeline PNG: {r['png']} (last step: {r['png_step'] or 'none: no backward span'})")
    return lines


def timeline_lines(last: dict[str, Any]) -> list[str]:
    lines = [f"# last timeline ({last['steps']} steps): backward {last['backward_ms']:.1f} ms, bucket GLOO_ALLREDUCE "
             f"busy {last['gloo_allreduce_busy_ms']:.1f} ms, overlap with backward {last['overlap_ms']:.1f} ms, "
             f"hidden {_fmt(None if last['hidden_fraction'] is None else 100 * last['hidden_fraction'], '.1f')}%",
             f"{'bucket':>30} {'bytes':>9} {'path':>18} {'n':>3} {'negotiate ms':>12} {'allreduce ms':>12} "
             f"{'start - backward end ms':>23}"]
    for b in last["buckets"]:
        lines.append(f"{b['bucket']:>30} {b['bytes']:9d} {b['path']:>18} {b['reductions']:3d} "
                     f"{_fmt(b['negotiate_ms_median'], '.2f'):>12} {_fmt(b['allreduce_ms_median'], '.2f'):>12} "
                     f"{_fmt(b['start_minus_backward_end_ms_median'], '.2f'):>23}")
    return lines


if __name__ == "__main__":
    main()
