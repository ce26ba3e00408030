"""Latency of a 1-element allreduce and bandwidth of a 64 MiB allreduce on CPU: gpucomm beside a raw
torch ``ProcessGroupGloo`` in the same processes, measured interleaved so machine noise hits both.

Run: ``torchrun --nproc-per-node 2 benchmarks/cpu_allreduce.py [--json out.json] [--quick]``
(or under gpucomm-run). Prints a table on rank 0 and writes JSON. ``--quick`` is a smoke run
(1 MiB large op, a few iterations). Counts out of range exit 2 with one line.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import gpucomm.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import fmt, median, percentile, ratio, scaled, write_json  # noqa: E402

# defaults: the full run and --quick
FULL = {"small_iters": 2000, "large_iters": 10, "large_mib": 64, "rounds": 5, "warmup": 50}
QUICK = {"small_iters": 20, "large_iters": 2, "large_mib": 1, "rounds": 2, "warmup": 2}


def raw_gloo_group() -> dist.ProcessGroupGloo:
    """A ProcessGroupGloo on its own TCPStore (port chosen by rank 0, shared through gpucomm)."""
    store = dist.TCPStore("127.0.0.1", 0, hvd.size(), True, wait_for_workers=False) if hvd.rank() == 0 else None
    port = hvd.broadcast_object(store.port if store else None, 0, name="raw_port")
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, hvd.size(), False)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=300)
    return dist.ProcessGroupGloo(store, hvd.rank(), hvd.size(), opts), store


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-iters", type=int, help=f"1-element allreduces in all (default {FULL['small_iters']})")
    ap.add_argument("--large-iters", type=int, help=f"large allreduces in all (default {FULL['large_iters']})")
    ap.add_argument("--large-mib", type=int, help=f"size of the large allreduce (default {FULL['large_mib']})")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (gpucomm, raw, gpucomm, raw, ...) "
                                               f"(default {FULL['rounds']})")
    ap.add_argument("--warmup", type=int, help=f"untimed small ops per implementation (default {FULL['warmup']})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    ap.add_argument("--json", default="cpu_allreduce.json")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.small_iters, args.large_iters, args.large_mib, args.rounds) < 1 or args.warmup < 0:
        ap.error("--small-iters, --large-iters, --large-mib and --rounds must be at least 1, --warmup at least 0")
    return args


def per_round(total: int, rounds: int, r: int) -> int:
    """Round ``r``'s share of ``total`` iterations (the shares add up to ``total``)."""
    return total // rounds + (1 if r < total % rounds else 0)


def impl_summary(r: dict[str, list[float]], nbytes: int) -> dict[str, float | None]:
    lat = sorted(r["small"])
    large = median(r["large"])
    return {"small_median_us": scaled(median(lat), 1e6), "small_p10_us": scaled(percentile(lat, 0.1), 1e6),
            "small_p90_us": scaled(percentile(lat, 0.9), 1e6), "large_median_ms": scaled(large, 1e3),
            "large_algbw_GBps": scaled(ratio(nbytes, large), 1e-9), "small_ops": len(lat), "large_ops": len(r["large"])}


def table(summary: dict[str, dict], lat_ratio: float | None, args: argparse.Namespace) -> list[str]:
    lines = [f"# ranks: {hvd.size()}  small: 1 x float32, {args.small_iters} iters; large: {args.large_mib} MiB, "
             f"{args.large_iters} iters; interleaved in {args.rounds} rounds",
             f"{'impl':>10} {'1-elem median us':>17} {'p10':>8} {'p90':>8} {f'{args.large_mib}MiB median ms':>16} "
             f"{'algbw GB/s':>11}"]
    for name, s in summary.items():
        lines.append(f"{name:>10} {fmt(s['small_median_us'], '.1f'):>17} {fmt(s['small_p10_us'], '.1f'):>8} "
                     f"{fmt(s['small_p90_us'], '.1f'):>8} {fmt(s['large_median_ms'], '.1f'):>16} "
                     f"{fmt(s['large_algbw_GBps'], '.3f'):>11}")
    lines.append(f"gpucomm / raw gloo small-op latency: {fmt(lat_ratio, '.2f')}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    pg, _store = raw_gloo_group()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    results: dict[str, dict[str, list[float]]] = {"gpucomm": {"small": [], "large": []}, "raw_gloo": {"small": [], "large": []}}
    small = torch.ones(1)
    large = torch.ones(args.large_mib << 18)  # float32: MiB * 2**20 / 4
    impls = {
        "gpucomm": lambda t: hvd.allreduce_(t, op=hvd.Sum),
        "raw_gloo": lambda t: pg.allreduce([t], opts).wait(),
    }
    for impl in impls.values():  # warm-up
        for _ in range(args.warmup):
            impl(small)
        impl(large)
    for r in range(args.rounds):
        for name, impl in impls.items():
            hvd.barrier()
            results[name]["small"] += timed(lambda: impl(small), per_round(args.small_iters, args.rounds, r))
            results[name]["large"] += timed(lambda: impl(large), per_round(args.large_iters, args.rounds, r))
        assert torch.isfinite(large).all()
    nbytes = large.numel() * 4
    summary = {name: impl_summary(r, nbytes) for name, r in results.items()}
    lat_ratio = ratio(summary["gpucomm"]["small_median_us"], summary["raw_gloo"]["small_median_us"])
    if hvd.rank() == 0:
        print("\n".join(table(summary, lat_ratio, args)))
        write_json(args.json, {"benchmark": "cpu_allreduce", "ranks": hvd.size(), "summary": summary,
                               "latency_ratio": lat_ratio, "args": vars(args)})
        print(f"wrote {args.json}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
