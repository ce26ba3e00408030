"""One-command GPU verification: tests, kernels, collectives and training, with one summary.

    python benchmarks/verify_gpu.py [--out bench-out] [--budget 540]

On a machine with one or more GPUs it runs, in order, each step with its own time limit:
1. the GPU tests (``pytest -m gpu``),
2. ``benchmarks/pack_bw.py`` (fusion kernels against torch.cat, _foreach_copy_ and a D2D copy),
3. the collectives sweep at 1 rank, then at 2 and 4 ranks (sharing one GPU through the single-GPU
   test mode when there are fewer GPUs than ranks),
4. the training benchmark against DDP at 1 rank (the scaling baseline) and at 2 ranks,
then prints one summary table, and leaves every JSON, PNG and log in ``--out``. It uses only the
repository and packages a CUDA PyTorch machine already has (torch, CuPy with NCCL, Numba CUDA,
pynvml, matplotlib, pytest, psutil). A step that fails or runs out of time is reported as such and
the run goes on, so one broken part never hides the others' numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


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
        Step("pack_bw", [PY, "benchmarks/pack_bw.py", "--json", str(out / "pack_bw.json")], 90, out / "pack_bw.json"),
        collectives(1, 90),
        train(1, 90),
        collectives(2, 90),
        train(2, 120),
        collectives(4, 90),
    ]


def run_step(step: Step, out: Path, budget_left: float) -> None:
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.status = f"timed out ({limit:.0f} s)"
        reader.join(timeout=10)
    step.seconds = time.monotonic() - t0
    if step.json_path is not None and step.json_path.exists():
        try:
            step.data = json.loads(step.json_path.read_text())
        except ValueError:
            step.status += ", JSON unreadable"
    if step.name == "gpu tests":
        step.data = tests_summary(out / "gpu_tests.xml")


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

    suite = ET.parse(xml).getroot()
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
    lines = [f"{name}: {'met' if ok else 'NOT met'}" for name, ok in d.get("targets", {}).items()]
    for r in d.get("rows", []):
        if r.get("method") == "gpucomm" and r.get("case") in ("one_64MiB", "resnet50"):
            lines.append(f"{r['case']} {r['op']}: {r['gbps']:.0f} GB/s = {r['pct_of_d2d']:.0f}% of D2D, "
                         f"host {r['host_us']:.1f} us")
    return lines


def summarize_collectives(step: Step) -> list[str]:
    """gpucomm's allreduce bus bandwidth against raw NCCL and torch.distributed at sizes >= 1 MiB."""
    d = step.data
    if not d:
        return []
    rows = [r for r in d.get("results", []) if r.get("collective") == "allreduce" and r.get("bytes", 0) >= 1 << 20]
    by_impl: dict[str, dict[int, float]] = {}
    for r in rows:
        by_impl.setdefault(r["impl"], {})[r["bytes"]] = r["out_of_place"]["busbw"]
    lines = []
    wrong = sum(int(r.get("out_of_place", {}).get("wrong", 0)) + int(r.get("in_place", {}).get("wrong", 0) or 0)
                for r in d.get("results", []))
    lines.append(f"#wrong over all collectives and sizes: {wrong}")
    ours = by_impl.get("gpucomm", {})
    for other in ("nccl", "torch"):
        theirs = by_impl.get(other, {})
        common = sorted(set(ours) & set(theirs))
        if common:
            ratios = [ours[s] / theirs[s] for s in common if theirs[s] > 0]
            lines.append(f"allreduce busbw gpucomm/{other} at >= 1 MiB: min {min(ratios):.3f}, "
                         f"at {common[-1] >> 20} MiB {ratios[-1]:.3f} ({ours[common[-1]]:.1f} vs "
                         f"{theirs[common[-1]]:.1f} GB/s)")
    return lines


def summarize_train(step: Step) -> list[str]:
    """Throughput of gpucomm against DDP (and plain training at 1 rank), and scaling efficiency."""
    d = step.data
    if not d:
        return []
    lines = []
    for name, m in d.get("models", {}).items():
        v = m["variants"]
        ratio = m["ratio_gpucomm_vs_ddp"]
        line = (f"{name}: gpucomm {v['gpucomm']['samples_per_s_total']:.1f} vs DDP {v['ddp']['samples_per_s_total']:.1f}"
                f" samples/s total, ratio {ratio['throughput_ratio']:.3f} (round quartiles "
                f"{ratio['quartiles'][0]:.3f}-{ratio['quartiles'][1]:.3f})")
        if m.get("overhead_vs_plain"):
            line += f", gpucomm/plain {m['overhead_vs_plain']['gpucomm']:.3f}"
        if m.get("scaling_efficiency"):
            eff = m["scaling_efficiency"]
            line += f", scaling efficiency gpucomm {eff['gpucomm']:.2f} / DDP {eff['ddp']:.2f}"
        lines.append(line)
    return lines


SUMMARIES: dict[str, Callable[[Step], list[str]]] = {"gpu tests": summarize_tests, "pack_bw": summarize_pack}


def summary_lines(step: Step) -> list[str]:
    fn = SUMMARIES.get(step.name)
    if fn is None:
        fn = summarize_collectives if step.name.startswith("collectives") else summarize_train
    try:
        return fn(step)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return [f"(could not summarize: {type(e).__name__}: {e})"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="folder for JSON, PNG and logs")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 9 minutes)")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (a smoke run)")
    args = ap.parse_args()
    gpus = gpu_count()
    if gpus == 0:
        print("verify_gpu: no CUDA GPU visible to torch; run this on a GPU machine.", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0)
    print(f"verify_gpu: {gpus} x {device}, torch {torch.__version__}; output in {out}", flush=True)
    t0 = time.monotonic()
    steps = plan(out, gpus, args.quick)
    for step in steps:
        left = args.budget - (time.monotonic() - t0)
        if left < 10:
            step.status = "skipped (budget spent)"
            continue
        run_step(step, out, left)
    total = time.monotonic() - t0
    lines = [f"# gpucomm GPU verification: {gpus} x {device}, torch {torch.__version__}, {total:.0f} s in all",
             f"{'step':<24} {'status':<22} {'s':>6}  figures"]
    for step in steps:
        figures = summary_lines(step) or [""]
        lines.append(f"{step.name:<24} {step.status:<22} {step.seconds:>6.0f}  {figures[0]}")
        lines += [f"{'':<24} {'':<22} {'':>6}  {f}" for f in figures[1:]]
    text = "\n".join(lines)
    print("\n" + text)
    (out / "summary.txt").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(
        {"device": device, "gpus": gpus, "seconds": total,
         "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds, "figures": summary_lines(s)}
                   for s in steps]}, indent=1))
    return 0 if all(s.status == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
