"""Start-up time: from launching an N-rank CPU job to its first completed allreduce.

Compares ``gpucomm-run`` + ``gpucomm.torch.init()`` with ``torchrun --nproc-per-node N`` +
``torch.distributed.init_process_group("gloo")``, and also gpucomm under torchrun. The runs are
interleaved (each repetition runs every launcher once per size) so machine noise hits all of them.

Run: ``python benchmarks/startup.py [--sizes 2 4 8] [--repeats 3] [--json startup.json] [--quick]``
(``--quick``: 2 ranks, one repeat). Each rank's worker is this file with ``--worker``; rank 0 prints the
wall-clock time at which its first allreduce completed, and the driver subtracts the time it launched
the job. A launcher that is not installed is left out and listed as not measured; a launch that fails
or times out is reported in its cell and in the JSON, and the run goes on (exit status 1 at the end).
Ctrl-C stops the launch under way, prints the table of what finished, writes the JSON and exits 130.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_stats import fmt, median, value_range, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARK = "FIRST_ALLREDUCE_DONE_AT"
LAUNCHERS = ("gpucomm-run", "torchrun", "torchrun+gpucomm")


class LaunchFailed(Exception):
    """One launch that did not produce a time; the message says why in one line."""


def worker(mode: str) -> None:
    import torch

    if mode == "gpucomm":
        import gpucomm.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(1), op=hvd.Sum)
        done, rank = time.time(), hvd.rank()
        if rank == 0:
            print(f"{MARK} {done:.6f}", flush=True)
        hvd.shutdown()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        done, rank = time.time(), dist.get_rank()
        if rank == 0:
            print(f"{MARK} {done:.6f}", flush=True)
        dist.destroy_process_group()


def _bin(name: str) -> list[str] | None:
    """The console script ``name`` next to this Python, else on PATH; None when neither exists."""
    exe = Path(sys.executable).with_name(name)
    if exe.exists():
        return [str(exe)]
    found = shutil.which(name)
    return [found] if found else None


def unavailable(launcher: str) -> str | None:
    """Why ``launcher`` cannot run here (None when it can)."""
    if launcher.startswith("torchrun") and _bin("torchrun") is None:
        return "torchrun is not installed next to this Python or on PATH"
    return None


def command(launcher: str, n: int) -> list[str]:
    me = str(Path(__file__).resolve())
    if launcher == "gpucomm-run":
        return [sys.executable, "-m", "gpucomm.runner", "-np", str(n), sys.executable, me, "--worker", "gpucomm"]
    mode = "gpucomm" if launcher == "torchrun+gpucomm" else "torch"
    return (_bin("torchrun") or ["torchrun"]) + ["--standalone", "--nproc-per-node", str(n), me, "--worker", mode]


def measure(launcher: str, n: int, timeout: float) -> tuple[float, float]:
    """(seconds to the first completed allreduce, seconds until the launcher exited); LaunchFailed
    when the launch fails, times out or prints no time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.time()
    try:
        proc = subprocess.run(command(launcher, n), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchFailed(f"timed out after {timeout:g} s") from None
    total = time.time() - t0
    if proc.returncode != 0:
        raise LaunchFailed(f"exit status {proc.returncode}: {last_line(proc.stderr)}")
    for line in proc.stdout.splitlines():
        if MARK in line:
            return float(line.split(MARK)[1]) - t0, total
    raise LaunchFailed(f"printed no {MARK} line: {last_line(proc.stderr)}")


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output on stderr)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["gpucomm", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", help="rank counts (default 2 4 8; --quick 2)")
    ap.add_argument("--repeats", type=int, help="launches per launcher and size (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --sizes 2 --repeats 1")
    ap.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launch (default %(default)s)")
    ap.add_argument("--json", default="startup.json")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [2] if args.quick else [2, 4, 8]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if min(args.sizes) < 1 or args.repeats < 1 or args.timeout <= 0:
        ap.error("--sizes and --repeats must be at least 1 and --timeout positive")
    return args


def run_all(args: argparse.Namespace, launchers: list[str]) -> tuple[dict, dict, bool]:
    """Every launcher at every size, ``--repeats`` times, interleaved: ({(launcher, n): [first s]},
    {(launcher, n): [failure reasons]}, whether Ctrl-C cut it short)."""
    first: dict[tuple[str, int], list[float]] = {}
    failures: dict[tuple[str, int], list[str]] = {}
    total: dict[tuple[str, int], list[float]] = {}
    try:
        for rep in range(args.repeats):
            for n in args.sizes:
                for launcher in launchers:
                    key = (launcher, n)
                    try:
                        f, t = measure(launcher, n, args.timeout)
                    except LaunchFailed as e:
                        failures.setdefault(key, []).append(str(e))
                        print(f"  repeat {rep + 1}/{args.repeats}: {launcher:17s} {n} ranks: failed: {e}",
                              file=sys.stderr, flush=True)
                        continue
                    first.setdefault(key, []).append(f)
                    total.setdefault(key, []).append(t)
                    print(f"  repeat {rep + 1}/{args.repeats}: {launcher:17s} {n} ranks: first allreduce at "
                          f"{f:6.2f} s, exit at {t:6.2f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return {"first": first, "exit": total}, failures, True
    return {"first": first, "exit": total}, failures, False


def cell(xs: list[float], failed: list[str]) -> str:
    if not xs:
        return "failed" if failed else "not measured"
    lo, hi = value_range(xs)
    text = f"{fmt(median(xs), '6.2f')} ({lo:5.2f}-{hi:5.2f})"
    return text + (f" {len(failed)} failed" if failed else "")


def report(args: argparse.Namespace, launchers: list[str], times: dict, failures: dict) -> list[dict]:
    """Print the table; return the JSON rows (one per launcher and size, measured or not)."""
    print(f"\nStart-up to first completed allreduce, CPU, {os.cpu_count()} cores, median of {args.repeats} "
          "(min-max), seconds")
    header = f"{'ranks':>5} | " + " | ".join(f"{name:>22s}" for name in launchers)
    print(header)
    print("-" * len(header))
    rows = []
    for n in args.sizes:
        cells = []
        for launcher in launchers:
            xs, failed = times["first"].get((launcher, n), []), failures.get((launcher, n), [])
            cells.append(cell(xs, failed))
            rows.append({"launcher": launcher, "ranks": n, "first_allreduce_s": xs,
                         "exit_s": times["exit"].get((launcher, n), []), "median_first_allreduce_s": median(xs),
                         "failures": failed})
        print(f"{n:>5} | " + " | ".join(f"{c:>22s}" for c in cells))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    not_measured = {name: reason for name in args.launchers if (reason := unavailable(name))}
    launchers = [name for name in args.launchers if name not in not_measured]
    times, failures, interrupted = run_all(args, launchers)
    rows = report(args, launchers, times, failures)
    for name, reason in not_measured.items():
        print(f"not measured: {name}: {reason}")
    failed = sum(len(f) for f in failures.values())
    if failed:
        print(f"{failed} launch(es) failed; the first reason: {next(iter(failures.values()))[0]}")
    if interrupted:
        print("interrupted: the table holds the launches that finished before Ctrl-C")
    write_json(args.json, {"benchmark": "startup", "cpus": os.cpu_count(), "repeats": args.repeats,
                           "interrupted": interrupted, "not_measured": not_measured, "results": rows})
    print(f"\nwrote {args.json}")
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
