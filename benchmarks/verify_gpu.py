"""One-command GPU verification: tests, kernels, collectives and training, with one summary.

    python benchmarks/verify_gpu.py [--out bench-out] [--budget 540] [--quick]
    python benchmarks/verify_gpu.py --dry-run              # print the plan, run nothing (no GPU needed)
    python benchmarks/verify_gpu.py --summarize-only --out bench-out   # the summary of results already there

On a machine with one or more GPUs it runs, in order, each step with its own time limit:
1. the GPU tests (``pytest -m gpu``),
2. ``benchmarks/pack_bw.py`` (fusion kernels against torch.cat, _foreach_copy_ and a D2D copy),
3. the collectives sweep at 1 rank, then at 2 and 4 ranks (sharing one GPU through the single-GPU
   test mode when there are fewer GPUs than ranks),
4. the training benchmark against DDP at 1 rank (the scaling baseline) and at 2 ranks,
then prints one summary table, and leaves every JSON, PNG and log in ``--out``. It uses only the
repository and packages a CUDA PyTorch machine already has (torch, CuPy with NCCL, Numba CUDA,
pynvml, matplotlib, pytest, psutil). A step that fails or runs out of time is reported as such and
the run goes on, so one broken part never hides the others' numbers; a step whose results are missing
or partial reads "no results" or "n/a" in the summary. Ctrl-C stops the step under way, then prints
the summary of what finished and exits 130.

Exit status: 0 when every step passed, 1 when one did not, 2 (one line on stderr) when there is no
CUDA GPU to run on (``--dry-run`` and ``--summarize-only`` need none), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_jobs import stop_group  # noqa: E402
from bench_stats import fmt, ratio as safe_ratio  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MIB = 1 << 20


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: float
    json_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"
    seconds: float = 0.0
    data: Any = None


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def launcher(n: int, gpus: int) -> list[str]:
    flags = ["--single-gpu-test"] if n > gpus else []
    return [PY, "-m", "gpucomm.runner", "-np", str(n), *flags, "--start-timeout", "120"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def plan(out: Path, gpus: int, quick: bool) -> list[Step]:
    """The steps, cheapest and most telling first, so a tight budget drops only the last ones.
    Ranks that share a GPU talk over loopback sockets, so their sweeps stop at smaller sizes."""
    own = "8M" if quick else "64M"  # largest size when every rank has its own GPU
    shared = "2M" if quick else "8M"
    plot = _has_matplotlib()

    def collectives(n: int, limit: float) -> Step:
        maxbytes = own if n <= gpus else shared
        argv = launcher(n, gpus) + [PY, "benchmarks/collectives.py", "--device", "cuda", "-b", "1K", "-e", maxbytes,
                                    "-f", "4", "-w", "3", "-n", "10" if n > 1 else "20",
                                    "--json", str(out / f"collectives_{n}.json")]
        argv += ["--plot", str(out / f"collectives_{n}.png")] if plot else ["--plot", ""]
        return Step(f"collectives {n} rank(s)", argv, limit, out / f"collectives_{n}.json")

    def train(n: int, limit: float) -> Step:
        argv = launcher(n, gpus) + [PY, "benchmarks/train.py", "--device", "cuda", "--warmup", "3", "--rounds", "4",
                                    "--steps-per-round", "5" if n <= gpus else "3",
                                    "--json", str(out / f"train_{n}.json")]
        if n > 1:
            argv += ["--baseline", str(out / "train_1.json")]
        if plot:
            argv += ["--plot", str(out / f"train_{n}.png")]
        return Step(f"train {n} rank" + ("s" if n > 1 else ""), argv, limit, out / f"train_{n}.json")

    return [
        Step("gpu tests", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "--junitxml", str(out / "gpu_tests.xml")], 240),
        Step("pack_bw", [PY, "benchmarks/pack_bw.py", "--json", str(out / "pack_bw.json")]
             + (["--quick"] if quick else []), 90, out / "pack_bw.json"),
        collectives(1, 90),
        train(1, 90),
        collectives(2, 90),
        train(2, 120),
        collectives(4, 90),
    ]


def run_step(step: Step, out: Path, budget_left: float) -> None:
    """Run ``step`` with its limit; its status, time and results (``step.data``) are filled in. Ctrl-C
    stops the step's process group, marks it interrupted and is raised again."""
    limit = min(step.timeout, max(10.0, budget_left))
    log = out / (step.name.replace(" ", "_").replace("(", "").replace(")", "") + ".log")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1",
               **step.env)
    print(f"== {step.name}: {' '.join(step.argv[1:])[:150]} (limit {limit:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        # a reader thread, so that a step that hangs without printing still meets its limit
        reader = threading.Thread(target=_copy_output, args=(proc.stdout, f), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
            step.status = "ok" if proc.returncode == 0 else f"failed ({proc.returncode})"
        except subprocess.TimeoutExpired:
            stop_group(proc)
            step.status = f"timed out ({limit:.0f} s)"
        except KeyboardInterrupt:
            stop_group(proc)
            step.status = "interrupted"
            raise
        finally:
            reader.join(timeout=10)
            step.seconds = time.monotonic() - t0
            load_results(step, out)


def load_results(step: Step, out: Path) -> None:
    """Read what ``step`` left in ``out`` into ``step.data``; unreadable JSON is noted in the status."""
    if step.name == "gpu tests":
        step.data = tests_summary(out / "gpu_tests.xml")
        return
    if step.json_path is None or not step.json_path.exists():
        return
    try:
        step.data = json.loads(step.json_path.read_text())
    except ValueError:
        step.status += ", JSON unreadable"


def _copy_output(pipe, log) -> None:
    for line in pipe:
        log.write(line)
        log.flush()
        sys.stdout.write("   " + line)
        sys.stdout.flush()


def tests_summary(xml: Path) -> dict[str, int] | None:
    if not xml.exists():
        return None
    import xml.etree.ElementTree as ET

    try:
        suite = ET.parse(xml).getroot()
    except ET.ParseError:  # a run stopped while pytest was writing it
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {k: int(suite.get(k, 0)) for k in keys} if suite is not None else None


# ----------------------------------------------------------------------------- summary lines


def summarize_tests(step: Step) -> list[str]:
    d = step.data
    if not d:
        return []
    passed = d["tests"] - d["failures"] - d["errors"] - d["skipped"]
    return [f"{passed} passed, {d['failures']} failed, {d['errors']} errors, {d['skipped']} skipped"]


def summarize_pack(step: Step) -> list[str]:
    d = step.data
    if not d:
        return []
    if d.get("skipped"):
        return [f"skipped: {d['skipped']}"]
    lines = [f"{name}: {'met' if ok else 'NOT met'}" for name, ok in (d.get("targets") or {}).items()]
    for r in d.get("rows") or []:
        if r.get("method") == "gpucomm" and r.get("case") in ("one_64MiB", "resnet50"):
            lines.append(f"{r['case']} {r.get('op')}: {fmt(r.get('gbps'), '.0f')} GB/s = "
                         f"{fmt(r.get('pct_of_d2d'), '.0f')}% of D2D, host {fmt(r.get('host_us'), '.1f')} us")
    return lines


def summarize_collectives(step: Step) -> list[str]:
    """#wrong over everything, then gpucomm's allreduce bandwidth against raw NCCL and torch.distributed
    at sizes >= 1 MiB (the largest size both measured, when the sweep stopped below 1 MiB). busbw,
    except at 1 rank, where nccl-tests' factor 2(n-1)/n makes it 0: then algbw."""
    d = step.data
    if not d:
        return []
    results = d.get("results", [])
    ranks = (d.get("env") or {}).get("ranks", 0)
    metric = "busbw" if ranks != 1 else "algbw"
    lines = [f"#wrong over all collectives and sizes: {count_wrong(results)}"]
    if (d.get("env") or {}).get("interrupted"):
        lines.append("interrupted: the sweep was stopped, these are its rows so far")
    ours = allreduce_bandwidth(results, "gpucomm", metric)
    if not ours:
        return lines + ["allreduce: gpucomm has no out-of-place allreduce rows: n/a"]
    not_measured = (d.get("env") or {}).get("not_measured") or {}
    for other in ("nccl", "torch"):
        line = compare_allreduce(ours, allreduce_bandwidth(results, other, metric), other, metric)
        if line is None and other in not_measured:
            line = f"allreduce gpucomm/{other}: not measured ({not_measured[other]})"
        if line is not None:
            lines.append(line)
    return lines


def count_wrong(results: list[dict[str, Any]]) -> int:
    """#wrong summed over every row and place; N/A places ({}) and unchecked ones (null) count 0."""
    total = 0
    for r in results:
        for place in ("out_of_place", "in_place"):
            total += int((r.get(place) or {}).get("wrong") or 0)
    return total


def allreduce_bandwidth(results: list[dict[str, Any]], impl: str, metric: str) -> dict[int, float]:
    """{bytes: out-of-place ``metric``} of ``impl``'s allreduce rows (first datatype/op seen per size)."""
    out: dict[int, float] = {}
    for r in results:
        value = (r.get("out_of_place") or {}).get(metric)
        if r.get("collective") == "allreduce" and r.get("impl") == impl and value is not None:
            out.setdefault(r["bytes"], value)
    return out


def compare_allreduce(ours: dict[int, float], theirs: dict[int, float], other: str, metric: str) -> str | None:
    """One line: the lowest gpucomm/``other`` ratio at >= 1 MiB and the ratio at the largest size (only
    that one when the sweep stopped below 1 MiB); None when ``other`` has no rows (it was not run)."""
    common = sorted(set(ours) & set(theirs))
    if not common:
        return None
    sizes = [s for s in common if s >= MIB] or common[-1:]
    ratios = {s: safe_ratio(ours[s], theirs[s]) for s in sizes}
    valid = [v for v in ratios.values() if v is not None]
    last = sizes[-1]
    head = f"allreduce {metric} gpucomm/{other}"
    if not valid:
        return f"{head}: n/a ({other} measured 0 GB/s)"
    at_last = f"{fmt(ratios[last], '.3f')} ({ours[last]:.3g} vs {theirs[last]:.3g} GB/s)"
    if last < MIB:
        return f"{head} at {size_text(last)} (the largest size; none >= 1 MiB): {at_last}"
    return f"{head} at >= 1 MiB: min {min(valid):.3f}, at {size_text(last)} {at_last}"


def size_text(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB and nbytes % MIB == 0 else f"{nbytes} B"


def summarize_train(step: Step) -> list[str]:
    """Throughput of gpucomm against DDP (and plain training at 1 rank), and scaling efficiency."""
    d = step.data
    if not d:
        return []
    return [train_line(name, m) for name, m in (d.get("models") or {}).items()]


def train_line(name: str, m: dict[str, Any]) -> str:
    v = m.get("variants") or {}
    ratio = m.get("ratio_gpucomm_vs_ddp") or {}
    line = (f"{name}: gpucomm {fmt(total_rate(v, 'gpucomm'), '.1f')} vs DDP {fmt(total_rate(v, 'ddp'), '.1f')}"
            f" samples/s total, ratio {fmt(ratio.get('throughput_ratio'), '.3f')} (round quartiles "
            f"{quartile_text(ratio.get('quartiles'))})")
    if m.get("overhead_vs_plain"):
        line += f", gpucomm/plain {fmt(m['overhead_vs_plain'].get('gpucomm'), '.3f')}"
    if m.get("scaling_efficiency"):
        eff = m["scaling_efficiency"]
        line += f", scaling efficiency gpucomm {fmt(eff.get('gpucomm'), '.2f')} / DDP {fmt(eff.get('ddp'), '.2f')}"
    return line


def total_rate(variants: dict[str, Any], name: str) -> float | None:
    return (variants.get(name) or {}).get("samples_per_s_total")


def quartile_text(q: list[float] | None) -> str:
    return f"{fmt(q[0], '.3f')}-{fmt(q[1], '.3f')}" if q else "n/a"


SUMMARIES: dict[str, Callable[[Step], list[str]]] = {"gpu tests": summarize_tests, "pack_bw": summarize_pack}


def summary_lines(step: Step) -> list[str]:
    fn = SUMMARIES.get(step.name)
    if fn is None:
        fn = summarize_collectives if step.name.startswith("collectives") else summarize_train
    try:
        return fn(step)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return [f"(could not summarize: {type(e).__name__}: {e})"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="folder for JSON, PNG and logs")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 9 minutes)")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (a smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their commands, run nothing")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: print and write the summary of the results already in --out")
    args = ap.parse_args(argv)
    if args.dry_run and args.summarize_only:
        ap.error("--dry-run and --summarize-only exclude each other; give one")
    if args.budget <= 0:
        ap.error(f"--budget {args.budget:g}: give a positive number of seconds")
    return args


def run_steps(steps: list[Step], out: Path, budget: float) -> bool:
    """Run the steps in order within ``budget`` seconds; False when Ctrl-C stopped them."""
    t0 = time.monotonic()
    for i, step in enumerate(steps):
        left = budget - (time.monotonic() - t0)
        if left < 10:
            step.status = "skipped (budget spent)"
            continue
        try:
            run_step(step, out, left)
        except KeyboardInterrupt:
            for rest in steps[i + 1:]:
                rest.status = "not run (interrupted)"
            return False
    return True


def read_existing(steps: list[Step], out: Path) -> None:
    """--summarize-only: each step's results as an earlier run left them."""
    for step in steps:
        load_results(step, out)
        step.status = "results found" if step.data else "no results"


def summary_text(steps: list[Step], header: str) -> str:
    lines = [header, f"{'step':<24} {'status':<22} {'s':>6}  figures"]
    for step in steps:
        figures = summary_lines(step) or [""]
        seconds = f"{step.seconds:>6.0f}" if step.seconds else f"{'-':>6}"
        lines.append(f"{step.name:<24} {step.status:<22} {seconds}  {figures[0]}")
        lines += [f"{'':<24} {'':<22} {'':>6}  {f}" for f in figures[1:]]
    return "\n".join(lines)


def write_summary(out: Path, steps: list[Step], text: str, device: str, gpus: int, seconds: float) -> None:
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(
        {"device": device, "gpus": gpus, "seconds": seconds,
         "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds, "figures": summary_lines(s)}
                   for s in steps]}, indent=1))


def print_plan(steps: list[Step], gpus: int) -> None:
    """--dry-run: every step's limit and command (for 1 GPU when none is visible here)."""
    print(f"verify_gpu: plan for {max(gpus, 1)} GPU(s){'' if gpus else ' (none visible here: assumed 1)'}")
    for step in steps:
        print(f"{step.name:<24} limit {step.timeout:>4.0f} s  {' '.join(step.argv[1:])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = 0 if args.summarize_only else gpu_count()  # summarizing needs no GPU (and no torch import)
    out = Path(args.out).resolve()
    if args.dry_run:
        print_plan(plan(out, max(gpus, 1), args.quick), gpus)
        return 0
    if gpus == 0 and not args.summarize_only:
        print("verify_gpu: no CUDA GPU visible to torch; run this on a GPU machine (or --dry-run / "
              "--summarize-only, which need none).", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    steps = plan(out, max(gpus, 1), args.quick)
    device = gpu_name() if gpus else "not run here"
    t0 = time.monotonic()
    finished = True
    if args.summarize_only:
        read_existing(steps, out)
        header = f"# gpucomm GPU verification, summary of the results in {out}"
    else:
        import torch

        print(f"verify_gpu: {gpus} x {device}, torch {torch.__version__}; output in {out}", flush=True)
        finished = run_steps(steps, out, args.budget)
        header = (f"# gpucomm GPU verification: {gpus} x {device}, torch {torch.__version__}, "
                  f"{time.monotonic() - t0:.0f} s in all" + ("" if finished else " (interrupted)"))
    text = summary_text(steps, header)
    print("\n" + text)
    write_summary(out, steps, text, device, gpus, time.monotonic() - t0)
    if not finished:
        return 130
    if args.summarize_only:
        return 0
    return 0 if all(s.status == "ok" for s in steps) else 1


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
