"""Pack/unpack bandwidth and host cost of gpucomm's fusion copies on one GPU, beside their anchors.

Cases: (a) one 64 MiB float32 tensor, (b) the 161 parameters of ResNet-50 (float32, 97.5 MiB),
(c) 1,000 tiny float32 tensors, (d) (b) packed float32 -> bfloat16 and unpacked back, (e) the same
with float16, (f) (b) unpacked with the average's scale (1/2), as DistributedOptimizer does.
Methods: ``kernel`` (``gpucomm.kernels.BoundCopy``, the optimizer's path: one launch, addresses
checked), ``kernel_api`` (``gpucomm.kernels.pack``/``unpack``, the generic entry), ``fallback``
(``gpucomm.dataplane.bucket_copy.TorchCopy``, the torch-ops path used where the kernels cannot
run), ``cat_split`` (``torch.cat`` in, per-tensor ``copy_`` out), and ``d2d`` (one
device-to-device copy of the same bytes: the anchor). GPU time is the median over ``--iters``
CUDA-event intervals of back-to-back calls after ``--warmup`` runs (a call slower on the host
than on the GPU shows its host time); GB/s counts bytes read + written; host time is the CPU cost
per call over back-to-back calls that do not fill the queue.

Run: ``python benchmarks/pack_bw.py [--json pack_bw.json] [--quick]``. Without a GPU (or without
gpucomm's CUDA kernels) it prints one line on stderr, writes ``{"skipped": <reason>}`` to ``--json``
when given, and exits with status 2.

Targets (issue 17): with the kernels, pack and unpack >= 85% of d2d on (a) and (b), the float16
and bfloat16 casts >= 85% both ways, 1,000 tiny tensors within 3x of one d2d copy of their bytes,
and <= 30 us of host time per launch on the 161-tensor bucket.
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


def make_case(name: str, shapes: list[tuple[int, ...]], wire: torch.dtype, unpack_scale: float = 1.0) -> dict:
    tensors = [torch.randn(s, device="cuda") for s in shapes]
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, device="cuda", dtype=wire)
    return {"name": name, "tensors": tensors, "flat": flat, "count": len(tensors), "unpack_scale": unpack_scale,
            "flat_views": list(flat.split([t.numel() for t in tensors])), "src_views": [t.view(-1) for t in tensors],
            "bytes": total * 4 + total * flat.element_size(), "wire": str(wire).replace("torch.", "")}


def methods(case: dict) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    from gpucomm import kernels
    from gpucomm.dataplane.bucket_copy import TorchCopy

    ts, flat, flat_views, src_views = case["tensors"], case["flat"], case["flat_views"], case["src_views"]
    scale = case["unpack_scale"]
    same = flat.dtype == ts[0].dtype
    scratch = torch.empty(flat.numel(), device="cuda", dtype=ts[0].dtype)
    d2d_src = torch.empty(case["bytes"] // 2, dtype=torch.uint8, device="cuda")  # read + written = bytes
    d2d_dst = torch.empty_like(d2d_src)
    bound_pack, bound_unpack = kernels.BoundCopy("pack"), kernels.BoundCopy("unpack", scale)
    torch_pack, torch_unpack = TorchCopy("pack", lean=True), TorchCopy("unpack", scale, lean=True)

    def cat_pack():
        if same:
            torch.cat(src_views, out=flat)
        else:  # torch.cat cannot cast into its output: concatenate, then convert
            torch.cat(src_views, out=scratch)
            flat.copy_(scratch)

    def split_unpack():
        for t, piece in zip(src_views, flat_views):
            t.copy_(piece)
        if scale != 1.0:
            torch._foreach_mul_(src_views, scale)

    return {
        "kernel": (lambda: bound_pack(ts, flat), lambda: bound_unpack(ts, flat)),
        "kernel_api": (lambda: kernels.pack(ts, flat), lambda: kernels.unpack(flat, ts, scale=scale)),
        "fallback": (lambda: torch_pack(ts, flat), lambda: torch_unpack(ts, flat)),
        "cat_split": (cat_pack, split_unpack),
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
    """Host microseconds per pack and unpack of ``case`` through ``BoundCopy`` for each launch path."""
    from gpucomm import kernels
    from gpucomm.kernels import launch

    out: dict[str, float] = {}
    ts, flat = case["tensors"], case["flat"]
    for mode in launch.MODES:
        os.environ["GPUCOMM_KERNEL_LAUNCH"] = mode
        pack, unpack = kernels.BoundCopy("pack"), kernels.BoundCopy("unpack", 0.5)
        pack(ts, flat)
        unpack(ts, flat)
        out[f"{mode}_pack"] = host_time(lambda: pack(ts, flat)) * 1e6
        out[f"{mode}_unpack"] = host_time(lambda: unpack(ts, flat)) * 1e6
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
             make_case("tiny_1000", tiny, torch.float32), make_case("resnet50_bf16", r50, torch.bfloat16),
             make_case("resnet50_f16", r50, torch.float16), make_case("resnet50_avg", r50, torch.float32, 0.5)]
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
                       "rows": rows, "host_costs_us": costs, "targets": checks, "kernels": kernel_facts()}, f,
                      indent=1)
    return 0


def print_table(rows: list[dict], costs: dict[str, float], iters: int) -> None:
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  iters {iters} (median)")
    print(f"{'case':<14} {'n':>5} {'wire':<8} {'method':<10} {'op':<7} {'gpu_us':>10} {'GB/s':>9} {'%d2d':>7} "
          f"{'host_us':>9}")
    for r in rows:
        pct = "n/a" if r["pct_of_d2d"] is None else f"{r['pct_of_d2d']:.1f}%"
        print(f"{r['case']:<14} {r['tensors']:>5} {r['wire']:<8} {r['method']:<10} {r['op']:<7} {r['gpu_us']:>10.1f} "
              f"{r['gbps']:>9.1f} {pct:>7} {r['host_us']:>9.1f}")
    print("# host us per BoundCopy call, resnet50 layout: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()
                                                                         if "ran_as" not in k))
    print("# launch paths: " + ", ".join(k for k in costs if "ran_as" in k))


def kernel_facts() -> dict:
    from gpucomm.kernels import status  # noqa: PLC0415

    st = status()
    return {k: st[k] for k in ("usable", "reason", "numpy_shims", "launch")}


def targets(rows: list[dict], costs: dict[str, float]) -> dict[str, bool]:
    """Issue 17's targets for the ``kernel`` method; a figure that is missing counts as not met."""
    def get(case, method, op, key):
        return next((r[key] for r in rows if (r["case"], r["method"], r["op"]) == (case, method, op)), None)

    def at_least(value, bar):
        return value is not None and value >= bar

    def at_most(value, bar):
        return value is not None and value <= bar

    both = ("pack", "unpack")
    tiny, tiny_d2d = get("tiny_1000", "kernel", "pack", "gpu_us"), get("tiny_1000", "d2d", "pack", "gpu_us")
    return {
        "pack_unpack_ge_85pct_d2d_64MiB_and_resnet50": all(
            at_least(get(c, "kernel", op, "pct_of_d2d"), 85.0) for c in ("one_64MiB", "resnet50") for op in both),
        "unpack_with_average_ge_85pct_d2d_resnet50": at_least(get("resnet50_avg", "kernel", "unpack", "pct_of_d2d"),
                                                              85.0),
        "casts_ge_85pct_d2d": all(at_least(get(c, "kernel", op, "pct_of_d2d"), 85.0)
                                  for c in ("resnet50_bf16", "resnet50_f16") for op in both),
        "tiny_1000_within_3x_d2d": tiny is not None and tiny_d2d is not None and tiny <= 3 * tiny_d2d,
        "resnet50_host_us_per_launch_le_30": all(at_most(get("resnet50", "kernel", op, "host_us"), 30.0)
                                                 for op in both),
    }


if __name__ == "__main__":
    sys.exit(main())
