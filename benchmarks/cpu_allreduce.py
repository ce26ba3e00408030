"""Latency of a 1-element allreduce and bandwidth of a 64 MiB allreduce on CPU: gpucomm beside a raw
torch ``ProcessGroupGloo`` in the same processes, measured interleaved so machine noise hits both.

Run: ``torchrun --nproc-per-node 2 benchmarks/cpu_allreduce.py [--json out.json]``
(or under gpucomm-run). Prints a table on rank 0 and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

import gpucomm.torch as hvd


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small-iters", type=int, default=2000)
    ap.add_argument("--large-iters", type=int, default=10)
    ap.add_argument("--large-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (gpucomm, raw, gpucomm, raw, ...)")
    ap.add_argument("--json", default="cpu_allreduce.json")
    args = ap.parse_args()
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
        for _ in range(50):
            impl(small)
        impl(large)
    for _ in range(args.rounds):
        for name, impl in impls.items():
            hvd.barrier()
            results[name]["small"] += timed(lambda: impl(small), args.small_iters // args.rounds)
            results[name]["large"] += timed(lambda: impl(large), max(1, args.large_iters // args.rounds))
        assert torch.isfinite(large).all()
    nbytes = large.numel() * 4
    summary = {}
    for name, r in results.items():
        lat = sorted(r["small"])
        summary[name] = {
            "small_median_us": statistics.median(lat) * 1e6,
            "small_p10_us": lat[len(lat) // 10] * 1e6,
            "small_p90_us": lat[len(lat) * 9 // 10] * 1e6,
            "large_median_ms": statistics.median(r["large"]) * 1e3,
            "large_algbw_GBps": nbytes / statistics.median(r["large"]) / 1e9,
        }
    ratio = summary["gpucomm"]["small_median_us"] / summary["raw_gloo"]["small_median_us"]
    if hvd.rank() == 0:
        print(f"# ranks: {hvd.size()}  small: 1 x float32, {args.small_iters} iters; large: {args.large_mib} MiB, "
              f"{args.large_iters} iters; interleaved in {args.rounds} rounds")
        print(f"{'impl':>10} {'1-elem median us':>17} {'p10':>8} {'p90':>8} {'64MiB median ms':>16} {'algbw GB/s':>11}")
        for name, s in summary.items():
            print(f"{name:>10} {s['small_median_us']:17.1f} {s['small_p10_us']:8.1f} {s['small_p90_us']:8.1f} "
                  f"{s['large_median_ms']:16.1f} {s['large_algbw_GBps']:11.3f}")
        print(f"gpucomm / raw gloo small-op latency: {ratio:.2f}x")
        with open(args.json, "w") as f:
            json.dump({"ranks": hvd.size(), "summary": summary, "latency_ratio": ratio, "args": vars(args)}, f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
