"""Where a training step's host time goes: gpucomm's ``DistributedOptimizer`` step under cProfile,
beside the same step with the plain optimizer (the anchor: what torch itself costs on the host).

For each variant (``gpucomm``, ``plain``) rank 0 profiles ``--steps`` steps after ``--warmup`` untimed
ones, each step ending in a device synchronize so queued GPU work is never charged to the next step;
while profiling, autograd runs backward in the calling thread (``set_multithreading_enabled(False)``),
so the hooks that CUDA backward would run on autograd's device thread are profiled too.
It prints the process CPU ms per step without the profiler (median of ``--rounds`` interleaved blocks),
the host's time to queue a step (``issue ms``: from a start with the GPU idle to the step's return; a hidden
wait for the GPU shows here), on a GPU the synchronizing CUDA calls a step makes and which lines of gpucomm
made them (torch's sync debug mode, ``sync_check.py``),
the Python calls per step (all, and those in gpucomm's own files), and gpucomm's heaviest functions by
own time and by cumulative time, then writes everything to ``--json``. The profiler slows Python down
(every call is hooked), so read its times as shares, not as the step's real cost; the CPU ms are
measured without it.

Run: ``gpucomm-run -np 1 python benchmarks/step_profile.py --model resnet50 --device cuda`` (or
``-np 2``; ``--device cpu --model cnn`` without a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import median, write_json  # noqa: E402
import anchors  # noqa: E402
from sync_check import SyncRecorder  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(hvd.__file__)).rsplit(os.sep, 1)[0]  # .../gpucomm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=models.MODELS, default="resnet50")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is visible")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per variant")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved unprofiled blocks for the CPU ms")
    ap.add_argument("--top", type=int, default=25, help="functions listed per table")
    ap.add_argument("--one-rank-reducer", action="store_true",
                    help="at 1 rank, run gpucomm's reducer as at N ranks (GPUCOMM_ONE_RANK_REDUCER=1), as DDP does")
    ap.add_argument("--json", default="step_profile.json")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible to torch")
    if min(args.batch_size, args.steps, args.rounds, args.top) < 1 or args.warmup < 0:
        ap.error("--batch-size, --steps, --rounds and --top must be >= 1, --warmup >= 0")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_body(model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, target: torch.Tensor):
    """One step's host work: what it queues, without waiting for the GPU at its end."""
    def body() -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
    return body


def make_step(body, device: torch.device):
    """``body``, then the host waits for the GPU (as a loop reading its loss would)."""
    def step() -> None:
        body()
        sync(device)
    return step


def issue_ms(body, device: torch.device, n: int) -> float:
    """Median wall ms from a step's start, the GPU idle, to the return of its last call: the host's time
    to queue the step. A step that blocks on the GPU somewhere (a hidden sync) shows here as a time near
    the whole step's, where one that only queues shows its host work alone."""
    times = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        body()
        times.append(time.perf_counter() - t0)
    sync(device)
    return median(times) * 1e3


def sync_calls(body, device: torch.device, n: int, top: int) -> dict[str, Any]:
    """The synchronizing CUDA calls ``n`` steps make (torch's sync debug mode; see sync_check.py): per
    step in all, those made through gpucomm, and gpucomm's lines that made them."""
    sync(device)
    with SyncRecorder(PACKAGE) as recorder:
        for _ in range(n):
            body()
    sync(device)
    ours = recorder.ours()
    return {"per_step": len(recorder.records) / n, "gpucomm_per_step": len(ours) / n,
            "gpucomm_lines": [{"line": k, "per_step": v / n} for k, v in recorder.by_line(ours).most_common(top)],
            "other_lines": [{"line": k, "per_step": v / n}
                            for k, v in (recorder.by_line() - recorder.by_line(ours)).most_common(top)]}


def cpu_ms(step, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        step()
    return (time.process_time() - t0) * 1e3 / n


def ours(filename: str) -> bool:
    return filename.startswith(PACKAGE + os.sep)


def profile(step, n: int, top: int) -> dict[str, Any]:
    """``n`` steps under cProfile: calls per step and gpucomm's heaviest functions."""
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # backward's hooks in this (profiled) thread
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    calls = mine = 0
    for (filename, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        calls += nc
        if ours(filename):
            mine += nc
            rows.append({"function": f"{os.path.relpath(filename, os.path.dirname(PACKAGE))}:{line}({name})",
                         "calls_per_step": nc / n, "own_us_per_step": tt * 1e6 / n, "cum_us_per_step": ct * 1e6 / n})
    # the C calls torch makes visible (``{method 'record' of ...}``) count too: gpucomm's own CUDA calls
    c_rows = []
    for (filename, line, name), (_cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~" and any(ours(c[0]) for c in callers):
            c_rows.append({"function": name, "calls_per_step": nc / n, "own_us_per_step": tt * 1e6 / n})
    return {"python_calls_per_step": calls / n, "gpucomm_calls_per_step": mine / n,
            "by_own_time": sorted(rows, key=lambda r: -r["own_us_per_step"])[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top],
            "builtins_called_by_gpucomm": sorted(c_rows, key=lambda r: -r["own_us_per_step"])[:top]}


def main() -> None:
    args = parse_args()
    anchors.ask_one_rank_reducer(args.one_rank_reducer)
    hvd.init()
    # gpucomm pinned this rank's GPU at init (the single-GPU test mode shares one among the ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    base, sample = models.build(args.model)
    theirs = models.build(args.model)[0]
    theirs.load_state_dict(base.state_dict())
    base.to(device)
    theirs.to(device)
    g = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, *sample, generator=g).to(device)
    target = torch.randint(0, 1000, (args.batch_size,), generator=g).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=base.named_parameters())
    bodies = {"gpucomm": make_body(base, opt, data, target),
              "plain": make_body(theirs, torch.optim.SGD(theirs.parameters(), lr=0.01, momentum=0.9), data, target)}
    steps = {name: make_step(body, device) for name, body in bodies.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            cpu[name].append(cpu_ms(steps[name], args.steps))
    issue: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            issue[name].append(issue_ms(bodies[name], device, args.steps))
    syncs = {name: sync_calls(body, device, args.steps, args.top) for name, body in bodies.items()} \
        if device.type == "cuda" else None
    before = hvd.stats()
    profiles = {"gpucomm": profile(steps["gpucomm"], args.steps, args.top)}
    after = hvd.stats()
    profiles["plain"] = profile(steps["plain"], args.steps, args.top)
    counters = {k: (after[k] - before[k]) / args.steps for k in after
                if isinstance(after[k], int) and after[k] != before[k]}
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    if rank != 0:
        return
    res = {"model": args.model, "device": args.device, "ranks": size,
           "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
           "cpu_ms_per_step": {name: median(v) for name, v in cpu.items()},
           "cpu_ms_rounds": cpu, "issue_ms_per_step": {name: median(v) for name, v in issue.items()},
           "issue_ms_rounds": issue, "sync_calls": syncs, "gpucomm_counters_per_step": counters,
           "profiles": profiles}
    report(res)
    write_json(args.json, res)
    print(f"# wrote {args.json}")


def report(res: dict[str, Any]) -> None:
    ms = res["cpu_ms_per_step"]
    print(f"# {res['model']} on {res['device']}, {res['ranks']} rank(s), batch {res['batch_size']}: "
          f"CPU ms per step gpucomm {ms['gpucomm']:.2f} | plain {ms['plain']:.2f} | added {ms['gpucomm'] - ms['plain']:.2f}")
    ms = res["issue_ms_per_step"]
    print(f"# issue ms per step (the host queueing a step from an idle start): gpucomm {ms['gpucomm']:.2f} | "
          f"plain {ms['plain']:.2f} | added {ms['gpucomm'] - ms['plain']:.2f}")
    syncs = res["sync_calls"]
    if syncs is not None:
        for name, found in syncs.items():
            print(f"# {name}: {found['per_step']:g} synchronizing CUDA calls per step, {found['gpucomm_per_step']:g} "
                  f"through gpucomm")
            for row in found["gpucomm_lines"] + found["other_lines"]:
                print(f"  {row['per_step']:7.1f}  {row['line']}")
    for name, p in res["profiles"].items():
        print(f"# {name}: {p['python_calls_per_step']:.0f} Python calls per step, "
              f"{p['gpucomm_calls_per_step']:.0f} of them in gpucomm")
    print("# gpucomm counters per step: " + ", ".join(f"{k} {v:g}" for k, v in res["gpucomm_counters_per_step"].items()))
    p = res["profiles"]["gpucomm"]
    for title, key, rows in (("own time", "own_us_per_step", p["by_own_time"]),
                             ("cumulative time", "cum_us_per_step", p["by_cumulative_time"]),
                             ("builtins called by gpucomm, own time", "own_us_per_step", p["builtins_called_by_gpucomm"])):
        print(f"# gpucomm functions by {title} (profiled us per step, calls per step):")
        for r in rows:
            print(f"  {r[key]:9.1f} us  {r['calls_per_step']:7.1f}  {r['function']}")


if __name__ == "__main__":
    main()
