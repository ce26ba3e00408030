"""Host cost of one cached collective: gpucomm beside the raw backend call and torch.distributed,
on the same tensors, in the same processes, measured interleaved.

For each form (allreduce, in-place allreduce, allreduce_async + synchronize, broadcast, allgather)
it prints the host microseconds per op (median over interleaved rounds of back-to-back ops; on a
GPU the time to *issue* them, then the GPU is drained untimed) and the Python function calls per
op (``sys.setprofile`` 'call' events, one op after warm-up). Anchors:

* raw backend: a ``ProcessGroupGloo`` called directly (CPU), or CuPy's ``NcclCommunicator`` on the
  current stream (GPU) — the floor any Python wrapper adds to;
* torch.distributed: ``dist.all_reduce`` / ``broadcast`` / ``all_gather_into_tensor`` on the
  default group (Gloo on CPU, NCCL on GPU).

Run: ``python benchmarks/overhead.py`` (1 rank) or ``gpucomm-run -np 2 python benchmarks/overhead.py``;
``--device cpu|cuda`` (default: cuda when available), ``--bytes 4096``, ``--quick`` for a smoke
run. Rank 0 prints the table and writes JSON (``--json``, default ``overhead.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import gpucomm.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import fmt, median, percentile, ratio, write_json  # noqa: E402
from torch_group import all_gather_into, gloo_collectives, init_torch_group  # noqa: E402

FULL = {"iters": 400, "rounds": 7, "warmup": 50}
QUICK = {"iters": 20, "rounds": 2, "warmup": 5}
FORMS = ("allreduce", "allreduce_", "allreduce_async", "broadcast", "allgather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the tensors live (default: cuda when a GPU is visible, else cpu)")
    ap.add_argument("--bytes", type=int, default=4096, help="tensor size in bytes (float32; default 4096)")
    ap.add_argument("--iters", type=int, help=f"ops per timed block (default {FULL['iters']})")
    ap.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    ap.add_argument("--warmup", type=int, help=f"untimed ops per implementation first (default {FULL['warmup']})")
    ap.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--json", default="overhead.json", help="where rank 0 writes the results")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.bytes < 4 or args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--bytes must be >= 4 and --iters/--rounds >= 1, --warmup >= 0")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU and a CUDA build of torch; this machine has none (use --device cpu)")
    return args


# -- the implementations ----------------------------------------------------------------------


def gpucomm_forms(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """gpucomm's forms, each a cached (named) op after the warm-up."""
    return {
        "allreduce": lambda: hvd.allreduce(x, name="ovh.ar"),
        "allreduce_": lambda: hvd.allreduce_(x, name="ovh.ar_", op=hvd.Sum),
        "allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(x, name="ovh.ara")),
        "broadcast": lambda: hvd.broadcast(x, 0, name="ovh.bc"),
        "allgather": lambda: hvd.allgather(x, name="ovh.ag"),
    }


def torch_forms(x: torch.Tensor, flat: bool = True) -> dict[str, Callable[[], Any]]:
    """``flat``: this torch has ``all_gather_into_tensor`` for the group (torch 2.1's Gloo has not)."""
    out = torch.empty(x.numel() * dist.get_world_size(), dtype=x.dtype, device=x.device)
    return {
        "allreduce": lambda: dist.all_reduce(x.clone()),  # not in place: like hvd.allreduce, a new tensor
        "allreduce_": lambda: dist.all_reduce(x),
        "allreduce_async": lambda: dist.all_reduce(x, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(x, 0),
        "allgather": lambda: all_gather_into(out, x, flat),
    }


def raw_gloo_forms(x: torch.Tensor, flat: bool = True) -> dict[str, Callable[[], Any]]:
    """The default group's ProcessGroupGloo, called without torch.distributed's Python wrapper (``flat``: it has
    a flat allgather; torch 2.1's gathers into one view of the output per rank)."""
    pg = dist.distributed_c10d._get_default_group()
    out = torch.empty(x.numel() * pg.size(), dtype=x.dtype, device=x.device)
    views = list(out.chunk(pg.size()))
    sum_opts = dist.AllreduceOptions()
    bc_opts = dist.BroadcastOptions()
    return {
        "allreduce": lambda: pg.allreduce([x.clone()], sum_opts).wait(),
        "allreduce_": lambda: pg.allreduce([x], sum_opts).wait(),
        "allreduce_async": lambda: pg.allreduce([x], sum_opts).wait(),
        "broadcast": lambda: pg.broadcast([x], bc_opts).wait(),
        "allgather": (lambda: pg._allgather_base(out, x).wait()) if flat else (lambda: pg.allgather([views], [x]).wait()),
    }


def raw_nccl_forms(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """CuPy's NcclCommunicator on torch's current stream (its own communicator, made here)."""
    from cupy.cuda import nccl  # noqa: PLC0415

    uid = hvd.broadcast_object(bytes(nccl.get_unique_id()) if hvd.rank() == 0 else None, 0, name="ovh.uid")
    comm = nccl.NcclCommunicator(hvd.size(), uid, hvd.rank())
    out = torch.empty(x.numel() * hvd.size(), dtype=x.dtype, device=x.device)
    n = x.numel()

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def allreduce_new():
        y = torch.empty_like(x)
        comm.allReduce(x.data_ptr(), y.data_ptr(), n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream())
        return y

    return {
        "allreduce": allreduce_new,
        "allreduce_": lambda: comm.allReduce(x.data_ptr(), x.data_ptr(), n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream()),
        "allreduce_async": lambda: comm.allReduce(x.data_ptr(), x.data_ptr(), n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                                  stream()),
        "broadcast": lambda: comm.broadcast(x.data_ptr(), x.data_ptr(), n, nccl.NCCL_FLOAT32, 0, stream()),
        "allgather": lambda: comm.allGather(x.data_ptr(), out.data_ptr(), n, nccl.NCCL_FLOAT32, stream()),
    }


# -- measuring --------------------------------------------------------------------------------


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls ('call' events) made by one ``fn()``."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0] - 1  # the lambda itself


def block_us(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Host microseconds per op over ``iters`` back-to-back ops (issue time on a GPU; then drained)."""
    hvd.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return elapsed / iters * 1e6


def measure(impls: dict[str, dict[str, Callable[[], Any]]], args: argparse.Namespace) -> dict[str, dict]:
    cuda = args.device == "cuda"
    for forms in impls.values():
        for fn in forms.values():
            for _ in range(args.warmup):
                fn()
    if cuda:
        torch.cuda.synchronize()
    samples: dict[tuple[str, str], list[float]] = {(i, f): [] for i, forms in impls.items() for f in forms}
    for _ in range(args.rounds):
        for form in FORMS:
            for impl, forms in impls.items():
                samples[(impl, form)].append(block_us(forms[form], args.iters, cuda))
    out: dict[str, dict] = {}
    for impl, forms in impls.items():
        for form, fn in forms.items():
            values = sorted(samples[(impl, form)])
            calls = python_calls(fn)
            if cuda:
                torch.cuda.synchronize()
            out.setdefault(impl, {})[form] = {"us_median": median(values), "us_p10": percentile(values, 0.1),
                                              "us_p90": percentile(values, 0.9), "python_calls": calls,
                                              "samples_us": values}
    return out


def report(results: dict[str, dict], args: argparse.Namespace, before: dict, after: dict) -> dict:
    raw = "raw_nccl" if args.device == "cuda" else "raw_gloo"
    lines = [f"# gpucomm host overhead per cached op: {hvd.size()} rank(s), {args.device}, {args.bytes} B float32, "
             f"{args.rounds} interleaved rounds x {args.iters} ops",
             f"# {'form':<16} {'gpucomm us':>11} {raw + ' us':>12} {'torch.dist us':>14} {'vs raw':>7} "
             f"{'vs torch':>8} {'gpucomm calls':>13} {'torch calls':>11}"]
    summary = {}
    for form in FORMS:
        ours, anchor, td = (results[i][form] for i in ("gpucomm", raw, "torch.distributed"))
        row = {"gpucomm_us": ours["us_median"], f"{raw}_us": anchor["us_median"], "torch_us": td["us_median"],
               "vs_raw": ratio(ours["us_median"], anchor["us_median"]),
               "vs_torch": ratio(ours["us_median"], td["us_median"]),
               "gpucomm_python_calls": ours["python_calls"], "torch_python_calls": td["python_calls"]}
        summary[form] = row
        lines.append(f"  {form:<16} {fmt(row['gpucomm_us'], '11.1f')} {fmt(row[f'{raw}_us'], '12.1f')} "
                     f"{fmt(row['torch_us'], '14.1f')} {fmt(row['vs_raw'], '7.2f')} {fmt(row['vs_torch'], '8.2f')} "
                     f"{ours['python_calls']:>13} {td['python_calls']:>11}")
    rounds = after["control_rounds"] - before["control_rounds"]
    ops = args.rounds * args.iters * len(FORMS) + args.warmup * len(FORMS)
    lines.append(f"# control rounds during the run: {rounds} for {ops} gpucomm ops "
                 f"({'none: a one-rank job negotiates nothing' if hvd.size() == 1 else 'one per synchronous op and barrier'})")
    print("\n".join(lines), flush=True)
    return {"benchmark": "overhead", "ranks": hvd.size(), "device": args.device, "bytes": args.bytes,
            "iters": args.iters, "rounds": args.rounds, "summary": summary, "results": results,
            "control_rounds": rounds, "gpucomm_ops": ops, "counters": after}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() if not os.environ.get("GPUCOMM_SINGLE_GPU_TEST") else 0)
    store = init_torch_group("nccl" if cuda else "gloo")
    x = torch.zeros(max(1, args.bytes // 4), dtype=torch.float32, device=args.device)  # sums stay finite
    flat = cuda or gloo_collectives()["allgather"]
    impls = {"gpucomm": gpucomm_forms(x),
             ("raw_nccl" if cuda else "raw_gloo"): raw_nccl_forms(x) if cuda else raw_gloo_forms(x, flat),
             "torch.distributed": torch_forms(x, flat)}
    before = hvd.stats()
    results = measure(impls, args)
    after = hvd.stats()
    if hvd.rank() == 0:
        doc = report(results, args, before, after)
        write_json(args.json, doc)
        print(f"# wrote {args.json}")
    hvd.barrier()
    dist.destroy_process_group()
    del store
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
