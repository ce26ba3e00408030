"""Pack/unpack bandwidth and host cost of gpucomm's fusion kernels on one GPU, beside torch.

Cases: (a) one 64 MiB float32 tensor, (b) the 161 parameters of ResNet-50 (float32, 97.5 MiB),
(c) 1,000 tiny float32 tensors, (d) (b) packed float32 -> bfloat16 and unpacked back. Methods:
``gpucomm`` (one kernel launch), ``cat_split`` (``torch.cat`` in, per-tensor ``copy_`` of
``split`` views out), ``foreach`` (``torch._foreach_copy_`` both ways), and ``d2d`` (one
device-to-device copy of the same bytes: the bar to compare with). GPU time is the median over
``--iters`` of CUDA-event intervals after ``--warmup`` runs; GB/s counts bytes read + written;
host time is the CPU cost per call, measured over back-to-back calls that do not fill the queue.

Run: ``python benchmarks/pack_bw.py [--json pack_bw.json] [--quick]``. Without a GPU (or without
gpucomm's CUDA kernels) it prints one line on stderr, writes ``{"skipped": <reason>}`` to ``--json``
when given, and exits with status 2.

Targets (issue): buckets >= 16 MiB pack and unpack at >= 85% of d2d bandwidth; on ResNet-50 the
pack beats ``torch.cat``; host time per launch <= 30 us.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50, in ``named_parameters()`` order (161 tensors)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            width, out = planes, planes * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]  # downsample conv + bn
            inplanes = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gpu_times(fn: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Seconds per call from CUDA events, one interval per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events]


def host_time(fn: Callable[[], None], calls: int = 50, repeats: int = 7) -> float:
    """Median CPU seconds per call over runs of ``calls`` back-to-back calls (queue drained between runs)."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return statistics.median(samples)


def make_case(name: str, shapes: list[tuple[int, ...]], wire: torch.dtype) -> dict:
    tensors = [torch.randn(s, device="cuda") for s in shapes]
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, device="cuda", dtype=wire)
    return {"name": name, "tensors": tensors, "flat": flat, "count": len(tensors),
            "flat_views": list(flat.split([t.numel() for t in tensors])), "src_views": [t.view(-1) for t in tensors],
            "bytes": total * 4 + total * flat.element_size(), "wire": str(wire).replace("torch.", "")}


def methods(case: dict) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    from gpucomm import kernels

    ts, flat, flat_views, src_views = case["tensors"], case["flat"], case["flat_views"], case["src_views"]
    same = flat.dtype == ts[0].dtype
    scratch = torch.empty(flat.numel(), device="cuda", dtype=ts[0].dtype)
    d2d_src = torch.empty(case["bytes"] // 2, dtype=torch.uint8, device="cuda")  # read + written = bytes
    d2d_dst = torch.empty_like(d2d_src)

    def cat_pack():
        if same:
            torch.cat(src_views, out=flat)
        else:  # torch.cat cannot cast into its output: concatenate, then convert
            torch.cat(src_views, out=scratch)
            flat.copy_(scratch)

    def split_unpack():
        for t, piece in zip(src_views, flat_views):
            t.copy_(piece)

    return {
        "gpucomm": (lambda: kernels.pack(ts, flat), lambda: kernels.unpack(flat, ts)),
        "cat_split": (cat_pack, split_unpack),
        "foreach": (lambda: torch._foreach_copy_(flat_views, src_views),
                    lambda: torch._foreach_copy_(src_views, flat_views)),
        "d2d": (lambda: d2d_dst.copy_(d2d_src), lambda: d2d_src.copy_(d2d_dst)),
    }


def run_case(case: dict, warmup: int, iters: int) -> list[dict]:
    rows = []
    impls = methods(case)
    for method, (pack_fn, unpack_fn) in impls.items():
        for op, fn in (("pack", pack_fn), ("unpack", unpack_fn)):
            t = statistics.median(gpu_times(fn, warmup, iters))
            rows.append({"case": case["name"], "tensors": case["count"], "wire": case["wire"], "method": method,
                         "op": op, "gpu_us": t * 1e6, "bytes": case["bytes"], "gbps": case["bytes"] / t / 1e9,
                         "host_us": host_time(fn) * 1e6})
    d2d = {r["op"]: r["gbps"] for r in rows if r["method"] == "d2d"}
    for r in rows:
        r["pct_of_d2d"] = 100.0 * r["gbps"] / d2d[r["op"]] if d2d.get(r["op"]) else None
    return rows


def launch_costs(case: dict) -> dict[str, float]:
    """Host microseconds per gpucomm pack of ``case`` for each launch path, with and without the
    per-call checks of a known layout (``validate``)."""
    from gpucomm import kernels
    from gpucomm.kernels import launch

    out: dict[str, float] = {}
    ts, flat = case["tensors"], case["flat"]
    for mode in ("direct", "numba"):
        os.environ["GPUCOMM_KERNEL_LAUNCH"] = mode
        for validate in (True, False):
            kernels.pack(ts, flat, validate=validate)
            out[f"{mode}_validate={validate}"] = host_time(lambda: kernels.pack(ts, flat, validate=validate)) * 1e6
        out[f"{mode}_ran_as_{launch.launch_mode()}"] = 1.0
    os.environ.pop("GPUCOMM_KERNEL_LAUNCH", None)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, help="timed runs per method and direction (default 30; --quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed runs first (default 5; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 timed runs after 1 warm-up")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    quick, full = (3, 1), (30, 5)
    for key, value in zip(("iters", "warmup"), quick if args.quick else full):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be at least 1 and --warmup at least 0")
    return args


def unavailable() -> str | None:
    """Why this machine cannot run the benchmark (None when it can)."""
    if not torch.cuda.is_available():
        return (f"needs a CUDA GPU, and torch.cuda.is_available() is False (torch {torch.__version__}); "
                "run it on a GPU machine")
    try:
        from gpucomm import kernels  # noqa: F401, PLC0415
    except ImportError as e:
        return f"needs gpucomm's CUDA kernels, which do not import ({e}); pip install 'gpucomm[cuda12]' or '[cuda13]'"
    return None


def skip(reason: str, json_path: str | None) -> int:
    print(f"pack_bw: skipped: {reason}", file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": "pack_bw", "skipped": reason, "rows": [], "targets": {}}, f, indent=1)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable()
    if reason:
        return skip(reason, args.json)
    torch.manual_seed(0)
    r50 = resnet50_shapes()
    assert len(r50) == 161 and sum(map(numel, r50)) == 25_557_032, "ResNet-50 shape list is off"
    tiny = [(1 + (i * 37) % 255,) for i in range(1000)]
    cases = [make_case("one_64MiB", [(16 << 20,)], torch.float32), make_case("resnet50", r50, torch.float32),
             make_case("tiny_1000", tiny, torch.float32), make_case("resnet50_bf16", r50, torch.bfloat16)]
    rows = [r for case in cases for r in run_case(case, args.warmup, args.iters)]
    costs = launch_costs(cases[1])
    print_table(rows, costs, args.iters)
    checks = targets(rows, costs)
    for name, ok in checks.items():
        print(f"# target {name}: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "pack_bw", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "python": platform.python_version(), "iters": args.iters, "warmup": args.warmup,
                       "rows": rows, "host_costs_us": costs, "targets": checks}, f, indent=1)
    return 0


def print_table(rows: list[dict], costs: dict[str, float], iters: int) -> None:
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  iters {iters} (median)")
    print(f"{'case':<14} {'n':>5} {'wire':<8} {'method':<10} {'op':<7} {'gpu_us':>10} {'GB/s':>9} {'%d2d':>7} "
          f"{'host_us':>9}")
    for r in rows:
        pct = "n/a" if r["pct_of_d2d"] is None else f"{r['pct_of_d2d']:.1f}%"
        print(f"{r['case']:<14} {r['tensors']:>5} {r['wire']:<8} {r['method']:<10} {r['op']:<7} {r['gpu_us']:>10.1f} "
              f"{r['gbps']:>9.1f} {pct:>7} {r['host_us']:>9.1f}")
    print("# host us per gpucomm pack, resnet50 layout: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()
                                                                       if "ran_as" not in k))
    print("# launch paths: " + ", ".join(k for k in costs if "ran_as" in k))


def targets(rows: list[dict], costs: dict[str, float]) -> dict[str, bool]:
    """The issue's targets; a figure that is missing counts as not met."""
    def get(case, method, op, key):
        return next((r[key] for r in rows if (r["case"], r["method"], r["op"]) == (case, method, op)), None)

    def at_least(value, bar):
        return value is not None and value >= bar

    def at_most(value, bar):
        return value is not None and value <= bar

    pack_us, cat_us = get("resnet50", "gpucomm", "pack", "gpu_us"), get("resnet50", "cat_split", "pack", "gpu_us")
    return {
        "bw_ge_85pct_d2d_for_16MiB_plus": all(at_least(get(c, "gpucomm", op, "pct_of_d2d"), 85.0)
                                              for c in ("one_64MiB", "resnet50") for op in ("pack", "unpack")),
        "resnet50_pack_faster_than_cat": pack_us is not None and cat_us is not None and pack_us < cat_us,
        "resnet50_host_us_per_launch_le_30": all(at_most(get("resnet50", "gpucomm", op, "host_us"), 30.0)
                                                 for op in ("pack", "unpack")),
        "resnet50_host_us_le_30_with_validate_false": at_most(costs.get("direct_validate=False"), 30.0),
    }


if __name__ == "__main__":
    sys.exit(main())
