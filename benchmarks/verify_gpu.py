"""One-command GPU verification: tests, kernels, collectives and training, with one committed summary.

    python benchmarks/verify_gpu.py --results [--commit SHA]   # into benchmarks/results/<date>-<gpu>/
    python benchmarks/verify_gpu.py --out DIR [--budget 540] [--quick]
    python benchmarks/verify_gpu.py --dry-run [--results]      # print the plan, run nothing (no GPU needed)
    python benchmarks/verify_gpu.py --summarize-only --out DIR # rebuild the summary from DIR/raw/

On a machine with one or more GPUs it runs, in order, each step with its own time limit, the whole run
within ``--budget`` seconds (default 540: one 10-minute session with room to spare), the most telling
steps first so a tight budget drops only the last ones:

1. the GPU tests (``pytest -m gpu``): pass/fail/skip of every test,
2. ``benchmarks/pack_bw.py``: the fusion kernels' pack/unpack GB/s as % of a device-to-device copy,
3. the collectives sweep at 1 rank: per-op microseconds and bandwidth of gpucomm beside raw NCCL and
   torch.distributed,
4. ResNet-50 at 2 ranks, gpucomm's DistributedOptimizer beside its anchors in the same job
   (``benchmarks/optimizer_vs_ddp.py``): DDP at its defaults, DDP at its best
   (``gradient_as_bucket_view=True, static_graph=True``) and the same steps with no communication, wall
   and process CPU time per step each; once with the gradients living in their buckets (the default) and
   once packed and unpacked by the fusion kernels every step (``GPUCOMM_GRADIENT_VIEWS=0``: the default
   chosen against), each with the counters that prove which path ran,
5. ResNet-50 at 1 rank with gpucomm's reducer on (``GPUCOMM_ONE_RANK_REDUCER=1``), as DDP runs its own
   at size 1: what each adds over the no-communication floor, and gpucomm's added time as a share of
   DDP-best's (issue 35's target: at most 0.5); then the same run with ``zero_grad()`` keeping the
   gradients in their buckets (``--zero-grad keep-views``: no bucket packs), the candidate GPU default,
   with the counters that prove no timed step packed; then where the one-rank reducer's host time goes
   (``benchmarks/step_profile.py``): CPU and queueing ms per step beside the plain optimizer's, the
   synchronizing CUDA calls gpucomm makes in a step and the lines that make them, its heaviest functions;
   then the reducer's host work alone (``benchmarks/reducer_host_cost.py``: ResNet-50's 161 parameters
   scaled down so that backward and the bytes cost nothing) beside DDP at its defaults and at its best,
6. the collectives sweep at 2 ranks, the training benchmark (``benchmarks/train.py``, the same four
   variants) at 1 and 2 ranks, and the sweep at 4 ranks.

Ranks share one GPU through gpucomm-run's single-GPU test mode when there are fewer GPUs than ranks
(their NCCL traffic then crosses loopback sockets); those steps set ``NCCL_SOCKET_NTHREADS`` and
``NCCL_NSOCKS_PERTHREAD`` (unless this run's environment already does; values and why in
benchmarks/anchors.py) so that loopback does not bury the difference, and the summary shows the values.
A step that fails or runs out of time is reported as such and the run goes on, so one broken part never
hides the others' numbers; the summary is rewritten after every step, so a run killed from outside still
leaves the summary of what finished.

Output in the ``--out`` folder: ``summary.json`` and ``summary.md`` (small, meant to be committed:
date, device, driver, CUDA/NCCL and package versions, commit, every GPU test's outcome, every figure
beside its anchor), ``summary.txt`` (the table printed at the end) and ``raw/`` (every log, JSON, PNG
and the junit XML; ``benchmarks/results/.gitignore`` keeps it out of git). ``--results`` picks
``benchmarks/results/<YYYY-MM-DD>-<gpu>`` and the run ends by printing the ``git add`` line. Where the
tree is a copy without ``.git``, ``--commit SHA`` records the commit it is.

Exit status: 0 when every step passed, 1 when one did not (or a ResNet-50 run did not take the fusion
path it asked for, or the 1-rank run's counters show gpucomm's reducer did not run), 2 (one line on
stderr) when there is no CUDA GPU to run on (``--dry-run`` and ``--summarize-only`` need none), 130 when
interrupted (the summary of what finished is still written).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, also when imported by path
from bench_jobs import stop_group  # noqa: E402
from bench_stats import fmt, fmt_pair, ratio as safe_ratio, write_json  # noqa: E402
import anchors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # gpucomm itself, for its version and NCCL's version text, when not installed
RESULTS = ROOT / "benchmarks" / "results"
RAW = "raw"  # the subfolder of --out that holds everything but the summary
PY = sys.executable
MIB = 1 << 20
KERNELS_ENV = "GPUCOMM_FUSION_KERNELS"
VIEWS_ENV = "GPUCOMM_GRADIENT_VIEWS"
KEEP_VIEWS_ENV = "GPUCOMM_ZERO_GRAD_KEEPS_VIEWS"
SCHEMA = 2  # 2: ResNet-50 and training figures carry every anchor (issue 35); collectives add in-place
COMMITTED = ("summary.json", "summary.md")


@dataclass
class Step:
    """One command of the run, its limit, where its results land, and (after it ran) how it went."""

    name: str
    argv: list[str]
    timeout: float
    json_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"
    seconds: float = 0.0
    data: Any = None
    interrupt_first: bool = False  # on timeout: SIGINT first (pytest then still writes its junit XML)


def gpu_count() -> int:
    """CUDA GPUs torch sees here (0 without a CUDA torch or a driver)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def launcher(n: int, gpus: int) -> list[str]:
    """gpucomm-run for ``n`` ranks; ranks share a GPU (single-GPU test mode) when there are fewer GPUs."""
    flags = ["--single-gpu-test"] if n > gpus else []
    return [PY, "-m", "gpucomm.runner", "-np", str(n), *flags, "--start-timeout", "120"]


def socket_env(n: int, gpus: int) -> dict[str, str]:
    """For ranks that share a GPU: NCCL's socket threads for loopback (benchmarks/anchors.py says why and
    cites NCCL's docs), except those this run's own environment already sets (the user's choice wins)."""
    return anchors.socket_env(os.environ) if n > gpus else {}


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def plan(out: Path, gpus: int, quick: bool) -> list[Step]:
    """The steps, most telling first, so a tight budget drops only the last ones. Every file a step
    writes goes under ``out/raw``. Ranks that share a GPU talk over loopback sockets, so their sweeps
    stop at smaller sizes, and their steps set NCCL's socket threads (``socket_env``). The first six
    limits add up to less than the default budget. Seen on an H100 (2026-11-27): the GPU tests take
    ~200 s when none hangs (117 tests, most of them multi-rank jobs), pack_bw 20 s, the 1-rank sweep 10 s,
    each ResNet-50 run ~25 s with two variants (four now: ~35 s), the 2-rank sweep 19 s, the training
    runs 42 and 34 s."""
    raw = out / RAW
    own = "8M" if quick else "64M"  # largest size when every rank has its own GPU
    shared = "2M" if quick else "8M"
    plot = _has_matplotlib()

    def collectives(n: int, limit: float) -> Step:
        maxbytes = own if n <= gpus else shared
        argv = launcher(n, gpus) + [PY, "benchmarks/collectives.py", "--device", "cuda", "-b", "8", "-e", maxbytes,
                                    "-f", "4", "-w", "3", "-n", "10" if n > 1 else "20",
                                    "--json", str(raw / f"collectives_{n}.json")]
        argv += ["--plot", str(raw / f"collectives_{n}.png")] if plot else ["--plot", ""]
        return Step(f"collectives {n} rank(s)", argv, limit, raw / f"collectives_{n}.json", socket_env(n, gpus))

    def resnet50(n: int, fusion: str, limit: float) -> Step:
        """ResNet-50 beside DDP at its defaults and its best and the no-comm floor: at 2 ranks with
        ``fusion`` "kernels" (gradients living in their buckets, the default), "packed" (every bucket
        packed and unpacked by the kernels every step: ``GPUCOMM_GRADIENT_VIEWS=0``, the default chosen
        against) or "fallback" (torch ops, forced); at 1 rank with the reducer on, and again with
        ``fusion`` "keep-views" (``--zero-grad keep-views``: zero_grad() zeroes the gradients in their
        buckets instead of freeing them, so no bucket packs: the candidate default on a GPU)."""
        counts = ["--quick"] if quick else ["--warmup", "3", "--rounds", "8", "--steps-per-round", "5"]
        tag = fusion if n > 1 or fusion == "keep-views" else "reducer-on"
        path = raw / f"resnet50_{n}_{tag}.json"
        argv = launcher(n, gpus) + [PY, "benchmarks/optimizer_vs_ddp.py", "--cuda", "--model", "resnet50",
                                    "--fusion", "torch" if fusion == "fallback" else "kernels", *counts,
                                    "--json", str(path)]
        argv += ["--one-rank-reducer", "on"] if n == 1 else []
        argv += ["--zero-grad", "keep-views"] if fusion == "keep-views" else []
        # explicit: a caller's setting must not leak in
        env = {KERNELS_ENV: "0" if fusion == "fallback" else "1", VIEWS_ENV: "0" if fusion == "packed" else "1",
               KEEP_VIEWS_ENV: "1" if fusion == "keep-views" else "0", **socket_env(n, gpus)}
        name = f"resnet50 {n} ranks {fusion}" if n > 1 else f"resnet50 1 rank {tag}"
        return Step(name, argv, limit, path, env)

    def train(n: int, limit: float) -> Step:
        argv = launcher(n, gpus) + [PY, "benchmarks/train.py", "--device", "cuda", "--models", "resnet50",
                                    "--warmup", "3", "--rounds", "4", "--steps-per-round", "5" if n <= gpus else "3",
                                    "--json", str(raw / f"train_{n}.json")]
        if n > 1:
            argv += ["--baseline", str(raw / "train_1.json")]
        if plot:
            argv += ["--plot", str(raw / f"train_{n}.png")]
        return Step(f"train {n} rank" + ("s" if n > 1 else ""), argv, limit, raw / f"train_{n}.json",
                    {KERNELS_ENV: "1", KEEP_VIEWS_ENV: "0", **socket_env(n, gpus)})

    pack_counts = ["--quick"] if quick else ["--iters", "10", "--warmup", "3"]
    return [
        Step("gpu tests", [PY, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
                           "--junitxml", str(raw / "gpu_tests.xml")], 290, interrupt_first=True),
        Step("pack_bw", [PY, "benchmarks/pack_bw.py", "--json", str(raw / "pack_bw.json"), *pack_counts], 40,
             raw / "pack_bw.json"),
        collectives(1, 30),
        resnet50(2, "kernels", 60),
        resnet50(2, "packed", 60),
        resnet50(1, "kernels", 50),
        resnet50(1, "keep-views", 50),
        Step("step profile 1 rank", launcher(1, gpus) + [
            PY, "benchmarks/step_profile.py", "--model", "resnet50", "--one-rank-reducer",  # --device: cuda if seen
            *(["--warmup", "2", "--steps", "3", "--rounds", "2"] if quick else
              ["--warmup", "5", "--steps", "10", "--rounds", "5"]),
            "--json", str(raw / "step_profile_1.json")], 60, raw / "step_profile_1.json",
             {KERNELS_ENV: "1", VIEWS_ENV: "1", KEEP_VIEWS_ENV: "0"}),
        Step("reducer host cost 1 rank", launcher(1, gpus) + [
            PY, "benchmarks/reducer_host_cost.py", "--cuda",
            *(["--quick"] if quick else ["--rounds", "8", "--steps-per-round", "20", "--warmup", "10"]),
            "--json", str(raw / "reducer_host_cost_1.json")], 40, raw / "reducer_host_cost_1.json",
             {KERNELS_ENV: "1", VIEWS_ENV: "1", KEEP_VIEWS_ENV: "0"}),
        Step("finite check 2 ranks", launcher(2, gpus) + [
            PY, "benchmarks/finite_check.py", "--cuda", "--model", "resnet50", "--mode", "auto",
            *(["--quick"] if quick else ["--rounds", "6", "--steps-per-round", "4", "--warmup", "2"]),
            "--json", str(raw / "finite_check_2.json")], 45, raw / "finite_check_2.json", socket_env(2, gpus)),
        collectives(2, 55),
        train(1, 70),
        train(2, 90),
        collectives(4, 70),
    ]


# ----------------------------------------------------------------------------- running


def run_step(step: Step, out: Path, budget_left: float) -> None:
    """Run ``step`` with its limit; its status, time and results (``step.data``) are filled in. Ctrl-C
    stops the step's process group, marks it interrupted and is raised again."""
    limit = min(step.timeout, max(10.0, budget_left))
    (out / RAW).mkdir(parents=True, exist_ok=True)
    log = log_path(out, step)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1",
               **step.env)
    shown = " ".join([*(f"{k}={v}" for k, v in step.env.items()), *step.argv[1:]])
    print(f"== {step.name}: {shown[:160]} (limit {limit:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        # SIGINT at its default in the step, even when this run was started in the background (which
        # ignores it), so that interrupt_first reaches it
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                preexec_fn=_default_sigint if step.interrupt_first else None)
        # a reader thread, so that a step that hangs without printing still meets its limit
        reader = threading.Thread(target=_copy_output, args=(proc.stdout, f), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
            step.status = "ok" if proc.returncode == 0 else f"failed ({proc.returncode})"
        except subprocess.TimeoutExpired:
            _stop(proc, step.interrupt_first)
            step.status = f"timed out ({limit:.0f} s)"
        except KeyboardInterrupt:
            _stop(proc, step.interrupt_first)
            step.status = "interrupted"
            raise
        finally:
            reader.join(timeout=10)
            step.seconds = time.monotonic() - t0
            load_results(step, out)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen, interrupt_first: bool, grace: float = 20.0) -> None:
    """Stop ``proc``'s process group: SIGINT first when asked (pytest writes its report on it), then
    SIGTERM and SIGKILL (``stop_group``)."""
    if interrupt_first:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    stop_group(proc)


def log_path(out: Path, step: Step) -> Path:
    return out / RAW / (step.name.replace(" ", "_").replace("(", "").replace(")", "") + ".log")


def _copy_output(pipe, log) -> None:
    for line in pipe:
        log.write(line)
        log.flush()
        sys.stdout.write("   " + line)
        sys.stdout.flush()


def _found(out: Path, path: Path) -> Path | None:
    """``path`` (under raw/), or the same name directly in ``out`` (older runs), or None."""
    for candidate in (path, out / path.name):
        if candidate.exists():
            return candidate
    return None


def load_results(step: Step, out: Path) -> None:
    """Read what ``step`` left in ``out`` into ``step.data``; unreadable JSON is noted in the status, and
    a ResNet-50 run whose fusion path is not the one it asked for is marked."""
    if step.name == "gpu tests":
        step.data = read_gpu_tests(out)
        return
    path = _found(out, step.json_path) if step.json_path is not None else None
    if path is None:
        return
    try:
        step.data = json.loads(path.read_text())
    except ValueError:
        step.status += ", JSON unreadable"
        return
    step.status += path_flag(step)


def path_flag(step: Step) -> str:
    """", fusion path NOT as asked" for a 2-rank ResNet-50 run whose fusion path is not the one it asked
    for; ", reducer NOT run" for the 1-rank run whose counters show gpucomm's reducer did not run."""
    if not step.name.startswith("resnet50"):
        return ""
    fig = resnet50_figures(step)
    if fig is None:
        return ""
    if fig["path_verified"] is False:
        return ", fusion path NOT as asked"
    return ", reducer NOT run" if fig["reducer_verified"] is False else ""


def run_steps(steps: list[Step], out: Path, budget: float, after_step: Callable[[], None] | None = None) -> bool:
    """Run the steps in order within ``budget`` seconds, calling ``after_step`` after each; False when
    Ctrl-C stopped them."""
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
        if after_step is not None:
            after_step()
    return True


def read_existing(steps: list[Step], out: Path) -> None:
    """--summarize-only: each step's results as an earlier run left them."""
    for step in steps:
        load_results(step, out)
        step.status = ("results found" if step.data else "no results") + path_flag(step)


# ----------------------------------------------------------------------------- GPU tests


_LOG_LINE = re.compile(r"^(?P<id>\S+::\S.*?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_LOG_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                 "XFAIL": "xfailed", "XPASS": "passed"}
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
_SEVERITY = {"passed": 0, "xfailed": 1, "skipped": 1, "error": 2, "failed": 3}


def read_gpu_tests(out: Path) -> dict[str, Any] | None:
    """The GPU tests' outcomes: from pytest's junit XML, else (a run stopped before pytest wrote it) from
    the ``-v`` lines of its log; None when neither is there."""
    xml = _found(out, out / RAW / "gpu_tests.xml")
    if xml is not None:
        parsed = parse_junit(xml, ROOT)
        if parsed is not None:
            return parsed
    log = out / RAW / "gpu_tests.log"
    if log.exists():
        return parse_pytest_log(log.read_text(errors="replace"))
    return None


def parse_junit(xml: Path, root: Path) -> dict[str, Any] | None:
    """Every testcase of a junit XML as {id, outcome, message}, with counts; None when unreadable (a
    run stopped while pytest was writing it). ``root`` is where the tests' files are (to rebuild ids)."""
    try:
        doc = ET.parse(xml).getroot()
    except ET.ParseError:
        return None
    cases = []
    for tc in doc.iter("testcase"):
        if not tc.get("name"):
            continue  # the entry pytest leaves for a test that a Ctrl-C stopped midway
        outcome, message = "passed", ""
        for child in tc:  # a test can carry more than one (a failure, then an error in teardown): keep the worst
            found = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if found == "skipped" and child.get("type") == "pytest.xfail":
                found = "xfailed"
            if found is not None and _SEVERITY[found] > _SEVERITY[outcome]:
                outcome, message = found, first_line(child.get("message") or child.text or "")
        cases.append({"id": node_id(tc.get("classname", ""), tc.get("name", ""), root), "outcome": outcome,
                      "message": message})
    return {"source": "junit XML", "counts": count_outcomes(cases), "cases": cases}


def parse_pytest_log(text: str) -> dict[str, Any]:
    """Outcomes from ``pytest -v`` lines (``path::test PASSED [ 5%]``): what finished before a stop."""
    worst: dict[str, str] = {}  # a test can show twice (FAILED, then ERROR in teardown): keep the worst
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m:
            outcome = _LOG_OUTCOMES[m["outcome"]]
            if _SEVERITY[outcome] >= _SEVERITY[worst.get(m["id"], "passed")]:
                worst[m["id"]] = outcome
    cases = [{"id": test, "outcome": outcome, "message": ""} for test, outcome in worst.items()]
    return {"source": "pytest log (the run was stopped before pytest wrote its XML; later tests are missing)",
            "counts": count_outcomes(cases), "cases": cases}


def count_outcomes(cases: list[dict[str, Any]]) -> dict[str, int]:
    counts = {o: 0 for o in OUTCOMES}
    for c in cases:
        counts[c["outcome"]] += 1
    return counts


def node_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id back from junit's dotted ``classname``: the longest dotted prefix that names a
    file under ``root`` is the path, the rest are classes."""
    parts = classname.split(".") if classname else []
    for k in range(len(parts), 0, -1):
        rel = "/".join(parts[:k]) + ".py"
        if (root / rel).is_file():
            return "::".join([rel, *parts[k:], name])
    return f"{classname}::{name}" if classname else name



def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


# ----------------------------------------------------------------------------- figures


def size_text(nbytes: int) -> str:
    """8 B, 4 KiB, 32 MiB (exact powers shown in their unit, anything else in bytes)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _by_size(results: list[dict[str, Any]], coll: str, impl: str,
             place: str = "out_of_place") -> dict[int, dict[str, Any]]:
    """{bytes: cell} of one collective, implementation and place ("out_of_place" or "in_place"; first
    datatype/op seen per size; a place the API lacks is an empty cell and left out)."""
    out: dict[int, dict[str, Any]] = {}
    for r in results:
        cell = r.get(place) or {}
        if r.get("collective") == coll and r.get("impl") == impl and cell:
            out.setdefault(r["bytes"], cell)
    return out


def collectives_figures(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per collective, gpucomm beside raw NCCL and torch.distributed: microseconds per call at the
    smallest size gpucomm measured, and bandwidth at its largest (busbw; algbw at 1 rank, where busbw is
    0 by definition). Ratios are gpucomm / other: above 1 is slower for time, faster for bandwidth."""
    if not data:
        return None
    env = data.get("env") or {}
    ranks = env.get("ranks", 0)
    metric = "busbw" if ranks != 1 else "algbw"
    results = data.get("results") or []
    colls = list(dict.fromkeys(r.get("collective") for r in results if r.get("impl") == "gpucomm"))
    latency, bandwidth, in_place = [], [], []
    for coll in colls:
        cells = {impl: _by_size(results, coll, impl) for impl in ("gpucomm", "nccl", "torch")}
        sizes = sorted(cells["gpucomm"])
        if not sizes:
            continue
        for rows, size, key in ((latency, sizes[0], "time_us"), (bandwidth, sizes[-1], metric)):
            rows.append(_compared(coll, size, {impl: (cells[impl].get(size) or {}).get(key) for impl in cells}))
        ours_ip = _by_size(results, coll, "gpucomm", "in_place")  # only where Horovod's API has an in-place form
        if ours_ip:
            size = min(ours_ip)
            in_place.append(_compared(coll, size, {impl: (_by_size(results, coll, impl, "in_place").get(size) or {})
                                                   .get("time_us") for impl in cells}))
    counters = env.get("gpucomm_counters") or {}
    return {"ranks": ranks, "single_gpu_test": bool(env.get("single_gpu_test")), "metric": metric,
            "wrong": count_wrong(results), "interrupted": bool(env.get("interrupted")),
            "not_measured": env.get("not_measured") or {}, "latency_us": latency, "bandwidth_gbps": bandwidth,
            "in_place_latency_us": in_place, "nccl_sockets": env.get("nccl_sockets"),
            "gpucomm_counters": {k: v for k, v in (counters.get("timed_calls") or {}).items() if v}}


def _compared(coll: str, size: int, values: dict[str, Any]) -> dict[str, Any]:
    """One row: gpucomm's, raw NCCL's and torch's figure and gpucomm's ratio to each."""
    return {"collective": coll, "bytes": size, **values,
            "gpucomm_vs_nccl": safe_ratio(values["gpucomm"], values["nccl"]),
            "gpucomm_vs_torch": safe_ratio(values["gpucomm"], values["torch"])}


def pack_figures(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per case and direction: the d2d anchor's GB/s, and the kernel's, the torch-ops fallback's and
    torch.cat/copy_'s GB/s as % of it, with the kernel's host microseconds per call."""
    if not data:
        return None
    if data.get("skipped"):
        return {"skipped": data["skipped"]}
    rows_in = data.get("rows") or []
    get = {(r.get("case"), r.get("method"), r.get("op")): r for r in rows_in}
    rows = []
    for case, op in dict.fromkeys((r.get("case"), r.get("op")) for r in rows_in):
        def cell(method: str, key: str) -> Any:
            return (get.get((case, method, op)) or {}).get(key)

        rows.append({"case": case, "op": op, "tensors": cell("d2d", "tensors"), "wire": cell("d2d", "wire"),
                     "d2d_gbps": cell("d2d", "gbps"), "kernel_gbps": cell("kernel", "gbps"),
                     "kernel_pct_of_d2d": cell("kernel", "pct_of_d2d"),
                     "fallback_pct_of_d2d": cell("fallback", "pct_of_d2d"),
                     "cat_split_pct_of_d2d": cell("cat_split", "pct_of_d2d"),
                     "kernel_host_us": cell("kernel", "host_us")})
    return {"device": data.get("device"), "iters": data.get("iters"), "rows": rows,
            "targets": data.get("targets") or {}, "kernels": data.get("kernels") or {}}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ms_pair(pair: list[float] | None) -> list[float] | None:
    return None if not pair else [pair[0] * 1e3, pair[1] * 1e3]


def fusion_asked(name: str) -> str | None:
    """The fusion path a ResNet-50 step asked for: "kernels", "packed" (the kernels, every step),
    "fallback", or None (the 1-rank reducer run, whose point is the reducer, not the pack path)."""
    if " 1 rank" in name:
        return None
    for path in ("fallback", "packed"):
        if name.endswith(path):
            return path
    return "kernels"


def optimizer_variants(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """optimizer_vs_ddp.py's variants, each with its anchors: wall and CPU ms per step (round quartiles),
    images/s, and its round-by-round ratios to ddp-best and ddp-default. A file written before the anchors
    existed (``median_step_s`` only) gives its wall times and nothing else."""
    ranks, batch = d.get("ranks") or 0, d.get("batch_size") or 0
    detail = d.get("variants") or {name: {"wall_s_per_step": s} for name, s in (d.get("median_step_s") or {}).items()}
    labels, rounds = d.get("labels") or {}, d.get("round_ratios") or {}
    out = {}
    for name, v in detail.items():
        paired = {key: (rounds.get(key) or {}).get(name) or {} for key in ("vs_ddp_best", "vs_ddp_default")}
        out[name] = {"label": labels.get(name, name), "wall_ms": _ms(v.get("wall_s_per_step")),
                     "wall_quartiles_ms": _ms_pair(v.get("wall_quartiles")), "cpu_ms": _ms(v.get("cpu_s_per_step")),
                     "cpu_quartiles_ms": _ms_pair(v.get("cpu_quartiles")),
                     "images_per_s": safe_ratio(batch * ranks, v.get("wall_s_per_step")),
                     **{f"{key}": ((d.get("ratios") or {}).get(key) or {}).get(name) for key in paired},
                     **{f"{key}_quartiles": p.get("quartiles") for key, p in paired.items()}}
    return out


def added_figures(d: dict[str, Any]) -> dict[str, Any]:
    """What each variant adds over the no-comm floor (ms per step, wall and CPU) and gpucomm's added time
    as a share of ddp-best's, against issue 35's target."""
    added = d.get("added_over_floor") or {}

    def ms_of(kind: str) -> dict[str, float | None]:
        return {v: _ms(x.get("median")) for v, x in (added.get(kind) or {}).items()}

    share = added.get("gpucomm_vs_ddp_best") or {}
    return {"wall_ms": ms_of("wall_s"), "cpu_ms": ms_of("cpu_s"), "gpucomm_vs_ddp_best_wall": share.get("wall_s"),
            "gpucomm_vs_ddp_best_cpu": share.get("cpu_s"), "target": added.get("target", anchors.TARGET_ADDED_RATIO)}


def resnet50_figures(step: Step) -> dict[str, Any] | None:
    """One optimizer_vs_ddp.py run: every variant's step times (wall and CPU) beside DDP at its defaults,
    DDP at its best and the no-comm floor, the time added over the floor, the NCCL socket settings, and
    what the run proves about itself: at 2 ranks whether the fusion path that ran (rank 0's
    ``gpucomm.kernels.status()`` and ``hvd.stats()['kernel_fallbacks']``) is the one asked for (kernels
    compiled and none given up, or torch ops and no kernel compiled); at 1 rank whether gpucomm's reducer ran."""
    d = step.data
    if not d:
        return None
    asked = fusion_asked(step.name)
    fusion = d.get("fusion") or {}
    compiled, fallbacks = fusion.get("compiled"), d.get("kernel_fallbacks")
    if asked in ("kernels", "packed"):
        ok = fusion.get("path") == "kernels" and bool(compiled) and fallbacks == 0
    elif asked == "fallback":
        ok = fusion.get("path") == "torch" and compiled == [] and fallbacks == 0
    else:
        ok = None
    reducer = d.get("one_rank_reducer") or {}
    variants = optimizer_variants(d)
    ours = variants.get(anchors.GPUCOMM) or {}
    return {"run": step.name, "fusion_asked": asked, "model": d.get("model"), "ranks": d.get("ranks"),
            "batch_per_rank": d.get("batch_size"), "variants": variants,
            "gpucomm_step_ms": ours.get("wall_ms"), "gpucomm_cpu_ms": ours.get("cpu_ms"),
            "gpucomm_vs_ddp_best": ours.get("vs_ddp_best"), "gpucomm_vs_ddp_default": ours.get("vs_ddp_default"),
            "gpucomm_images_per_s": ours.get("images_per_s"), "added_over_floor": added_figures(d),
            "nccl_sockets": d.get("nccl_sockets"), "one_rank_reducer": reducer or None,
            "fusion_path": fusion.get("path"),
            "compiled_kernels": len(compiled) if isinstance(compiled, list) else None,
            "kernel_launch": fusion.get("launch"), "kernel_fallbacks": fallbacks,
            "fallback_reason": fusion.get("reason") or "", "path_verified": ok,
            "gradient_path": gradient_path(d), "zero_grad": d.get("zero_grad"),
            "zero_grad_verified": zero_grad_verified(d),
            "reducer_verified": reducer.get("verified") if reducer.get("asked") else None}


def zero_grad_verified(d: dict[str, Any]) -> bool | None:
    """A keep-views run: True when gpucomm's timed steps packed no bucket and bound views (its counters), None
    for the other modes."""
    if d.get("zero_grad") != "keep-views":
        return None
    counts = (d.get("gpucomm_counters") or {}).get(anchors.GPUCOMM) or {}
    return counts.get("grad_bucket_packs") == 0 and (counts.get("grad_bucket_views") or 0) > 0


def gradient_path(d: dict[str, Any]) -> dict[str, Any]:
    """How gpucomm's timed steps moved their gradients (rank 0's counters): bucket launches whose
    gradients already lived in the buffer, packs and unpacks, and the CUDA events recorded and stream
    waits enqueued, per timed step."""
    counts = (d.get("gpucomm_counters") or {}).get(anchors.GPUCOMM) or {}
    steps = (d.get("rounds") or 0) * (d.get("steps_per_round") or 0)
    keys = ("grad_bucket_views", "grad_bucket_packs", "grad_bucket_unpacks", "cuda_event_records", "cuda_stream_waits")
    return {k: counts.get(k) for k in keys} | {"per_step": {k: safe_ratio(counts.get(k), steps) for k in keys}
                                                if steps else None}


def _ratio_of(m: dict[str, Any], key: str, name: str) -> dict[str, Any]:
    return ((m.get("ratios") or {}).get(key) or {}).get(name) or {}


def train_figures(step: Step) -> list[dict[str, Any]]:
    """Per model of a train.py run: every variant's total samples/s, ms and CPU ms per step, its ratios
    to ddp-best, ddp-default and the floor (round by round), and scaling efficiency; gpucomm's added time
    over the floor as a share of ddp-best's; the one-rank reducer and the socket settings."""
    d = step.data or {}
    labels = d.get("labels") or {}
    rows = []
    for name, m in (d.get("models") or {}).items():
        eff = m.get("scaling_efficiency") or {}
        variants = {v: {"label": labels.get(v, v), "samples_per_s": r.get("samples_per_s_total"),
                        "wall_ms": _ms(r.get("wall_s_per_step")), "cpu_ms": _ms(r.get("cpu_s_per_step")),
                        **{key: _ratio_of(m, key, v).get("throughput_ratio")
                           for key in ("vs_ddp_best", "vs_ddp_default", "vs_no_comm")},
                        "scaling_efficiency": eff.get(v)}
                    for v, r in (m.get("variants") or {}).items()}
        best = _ratio_of(m, "vs_ddp_best", anchors.GPUCOMM)
        rows.append({"ranks": d.get("ranks"), "model": name, "batch_per_rank": d.get("batch_size"),
                     "variants": variants, "gpucomm_vs_ddp_best": best.get("throughput_ratio"),
                     "gpucomm_vs_ddp_best_quartiles": best.get("quartiles"),
                     "gpucomm_vs_ddp_default": _ratio_of(m, "vs_ddp_default", anchors.GPUCOMM).get("throughput_ratio"),
                     "gpucomm_vs_no_comm": _ratio_of(m, "vs_no_comm", anchors.GPUCOMM).get("throughput_ratio"),
                     "added_over_floor": added_figures(m), "scaling_efficiency": m.get("scaling_efficiency"),
                     "one_rank_reducer": d.get("one_rank_reducer"), "nccl_sockets": d.get("nccl_sockets")})
    return rows


# ----------------------------------------------------------------------------- one-line figures per step


def summarize_tests(step: Step) -> list[str]:
    d = step.data
    if not d:
        return []
    c = d["counts"]
    line = (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
            + (f", {c['xfailed']} xfailed" if c["xfailed"] else ""))
    return [line] + ([] if d["source"] == "junit XML" else [f"from the {d['source']}"])


def summarize_pack(step: Step) -> list[str]:
    d = step.data
    if not d:
        return []
    if d.get("skipped"):
        return [f"skipped: {d['skipped']}"]
    lines = [f"{name}: {'met' if ok else 'NOT met'}" for name, ok in (d.get("targets") or {}).items()]
    for r in d.get("rows") or []:
        if r.get("method") == "kernel" and r.get("case") in ("one_64MiB", "resnet50"):
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
        return f"{head} at {_bytes_text(last)} (the largest size; none >= 1 MiB): {at_last}"
    return f"{head} at >= 1 MiB: min {min(valid):.3f}, at {_bytes_text(last)} {at_last}"


def _bytes_text(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB and nbytes % MIB == 0 else f"{nbytes} B"


def _per_variant(variants: dict[str, dict[str, Any]], key: str, spec: str) -> str:
    """"gpucomm 97.2 | ddp-default 91.1 | ..." of one figure of every variant."""
    return " | ".join(f"{v['label']} {fmt(v.get(key), spec)}" for v in variants.values())


def added_line(added: dict[str, Any]) -> str:
    """Time added over the no-comm floor, gpucomm's share of ddp-best's, and the target."""
    wall, cpu = added["wall_ms"], added["cpu_ms"]
    parts = " | ".join(f"{v} {fmt(ms, '.1f')} / {fmt(cpu.get(v), '.1f')}" for v, ms in wall.items())
    return (f"added over no-comm, wall / CPU ms per step: {parts or 'n/a'}; gpucomm / ddp-best added "
            f"{fmt(added['gpucomm_vs_ddp_best_wall'], '.2f')} wall, {fmt(added['gpucomm_vs_ddp_best_cpu'], '.2f')} "
            f"CPU (target <= {added['target']})")


def sockets_text(record: dict[str, Any] | None) -> str | None:
    """The NCCL socket settings of a run whose ranks shared a GPU (None otherwise)."""
    if not record or not record.get("single_gpu_test"):
        return None
    values = ", ".join(f"{k}={v}" for k, v in (record.get("values") or {}).items())
    return f"NCCL sockets (ranks share a GPU): {values} (set by {record.get('set_by')})"


def reducer_text(record: dict[str, Any] | None) -> str | None:
    """The one-rank reducer of a 1-rank run: asked or not, and whether gpucomm's counters show it ran."""
    if not record or not record.get("applies"):
        return None
    if not record.get("asked"):
        return "one-rank reducer: off (gpucomm's optimizer does nothing at size 1)"
    ran = "ran (gpucomm's counters moved)" if record.get("verified") else "NOT run (no gpucomm counter moved)"
    return f"one-rank reducer: asked ({record.get('variable')}), {ran}"


def zero_grad_text(figures: dict[str, Any]) -> str:
    """How the run's variants cleared their gradients, when not torch's default ("" then), and for
    keep-views whether the counters show it (no timed step packed a bucket)."""
    mode = figures.get("zero_grad")
    if mode in (None, "free"):
        return ""
    ok = figures.get("zero_grad_verified")
    proof = "" if ok is None else "; no timed step packed: " + ("yes" if ok else "NO")
    return f"zero_grad: {mode} (benchmarks/optimizer_vs_ddp.py --zero-grad){proof}"


def summarize_resnet50(step: Step) -> list[str]:
    """Each variant's wall and CPU ms per step, gpucomm's ratios to both DDP anchors, the time added over
    the floor, and what the run proves about its own path (fusion at 2 ranks, the reducer at 1)."""
    f = resnet50_figures(step)
    if f is None:
        return []
    v, ours = f["variants"], f["variants"].get(anchors.GPUCOMM) or {}
    lines = [f"wall ms/step: {_per_variant(v, 'wall_ms', '.1f')}", f"CPU ms/step: {_per_variant(v, 'cpu_ms', '.1f')}",
             f"gpucomm / ddp-best {fmt(ours.get('vs_ddp_best'), '.3f')} (round quartiles "
             f"{fmt_pair(ours.get('vs_ddp_best_quartiles'), '.3f')}), / ddp-default "
             f"{fmt(ours.get('vs_ddp_default'), '.3f')} (round quartiles "
             f"{fmt_pair(ours.get('vs_ddp_default_quartiles'), '.3f')})", added_line(f["added_over_floor"])]
    lines += [t for t in (sockets_text(f["nccl_sockets"]), reducer_text(f["one_rank_reducer"]), zero_grad_text(f))
              if t]
    if f["fusion_asked"] is not None:
        lines.append(f"fusion path {f['fusion_path'] or 'n/a'} ({fmt(f['compiled_kernels'])} kernels compiled, "
                     f"kernel_fallbacks {fmt(f['kernel_fallbacks'])}): "
                     f"{'as asked' if f['path_verified'] else 'NOT as asked'}"
                     + (f"; reason: {f['fallback_reason']}" if f["fallback_reason"] else ""))
    return lines


def summarize_train(step: Step) -> list[str]:
    """Per model: every variant's samples/s and ms (CPU ms) per step, gpucomm's ratios to its anchors,
    the time added over the floor, scaling efficiency; the reducer and the socket settings."""
    lines = []
    for row in train_figures(step):
        v, name = row["variants"], row["model"]
        lines += [f"{name}: samples/s {_per_variant(v, 'samples_per_s', '.1f')}",
                  f"{name}: ms/step {_per_variant(v, 'wall_ms', '.2f')}; "
                  f"CPU ms/step {_per_variant(v, 'cpu_ms', '.2f')}",
                  f"{name}: gpucomm / ddp-best {fmt(row['gpucomm_vs_ddp_best'], '.3f')} (round quartiles "
                  f"{fmt_pair(row['gpucomm_vs_ddp_best_quartiles'], '.3f')}), / ddp-default "
                  f"{fmt(row['gpucomm_vs_ddp_default'], '.3f')}, / no-comm {fmt(row['gpucomm_vs_no_comm'], '.3f')}",
                  f"{name}: {added_line(row['added_over_floor'])}"]
        if row["scaling_efficiency"]:
            lines.append(f"{name}: scaling efficiency {_per_variant(v, 'scaling_efficiency', '.2f')}")
    first = (train_figures(step) or [{}])[0]
    lines += [t for t in (sockets_text(first.get("nccl_sockets")), reducer_text(first.get("one_rank_reducer"))) if t]
    return lines


def summarize_finite_check(step: Step) -> list[str]:
    """The default finite check's cost beside the same step without it (benchmarks/finite_check.py)."""
    d = step.data or {}
    if not d:
        return []
    q = d.get("ratio_quartiles") or [None, None]
    times = d.get("step_s") or {}
    return [f"{d.get('model')}: checked ({d.get('mode')}) {fmt(_ms(times.get('checked')), '.2f')} ms vs plain "
            f"{fmt(_ms(times.get('plain')), '.2f')} ms per step: {fmt(d.get('cost_pct_of_step'), '+.2f')}% of the "
            f"step (round quartiles {fmt(q[0], '.4f')}-{fmt(q[1], '.4f')}; issue 36: the default if <= 1 %)"]


def step_profile_figures(d: Any) -> dict[str, Any] | None:
    """The host-time figures of ``benchmarks/step_profile.py``'s JSON, without its long tables."""
    if not d:
        return None
    syncs = d.get("sync_calls") or {}
    ours = syncs.get("gpucomm") or {}
    profile = (d.get("profiles") or {}).get("gpucomm") or {}
    return {"model": d.get("model"), "ranks": d.get("ranks"), "device": d.get("device"),
            "cpu_ms_per_step": d.get("cpu_ms_per_step"), "issue_ms_per_step": d.get("issue_ms_per_step"),
            "sync_calls_per_step": {name: found.get("per_step") for name, found in syncs.items()} or None,
            "gpucomm_sync_calls_per_step": ours.get("gpucomm_per_step"),
            "gpucomm_sync_lines": ours.get("gpucomm_lines"),
            "gpucomm_python_calls_per_step": profile.get("gpucomm_calls_per_step"),
            "heaviest_own_us_per_step": [(r["function"], r["own_us_per_step"])
                                         for r in profile.get("by_own_time", [])[:8]],
            "counters_per_step": d.get("gpucomm_counters_per_step")}


def summarize_step_profile(step: Step) -> list[str]:
    """Where the one-rank reducer's host time goes (issue 35): the CPU and queueing time it adds over the
    plain optimizer's step, the synchronizing CUDA calls gpucomm makes in a step, its heaviest functions."""
    f = step_profile_figures(step.data)
    if f is None:
        return []

    def added(key: str) -> str:
        v = f.get(key) or {}
        a, b = v.get("gpucomm"), v.get("plain")
        diff = a - b if a is not None and b is not None else None
        return f"gpucomm {fmt(a, '.2f')} | plain {fmt(b, '.2f')} | added {fmt(diff, '.2f')}"

    lines = [f"{f['model']}, {f['ranks']} rank(s), reducer on: CPU ms/step {added('cpu_ms_per_step')}",
             f"issue ms/step (the host queueing a step): {added('issue_ms_per_step')}"]
    syncs = f.get("sync_calls_per_step")
    if syncs is not None:
        where = ", ".join(f"{r['line']} x{r['per_step']:g}" for r in (f.get("gpucomm_sync_lines") or [])[:3])
        lines.append(f"synchronizing CUDA calls per step: {fmt(f.get('gpucomm_sync_calls_per_step'), 'g')} through "
                     f"gpucomm{' (' + where + ')' if where else ''}; the plain step's {fmt(syncs.get('plain'), 'g')}")
    heaviest = ", ".join(f"{name} {us:.0f}" for name, us in f["heaviest_own_us_per_step"][:3])
    lines.append(f"Python calls per step in gpucomm: {fmt(f.get('gpucomm_python_calls_per_step'), '.0f')}; heaviest "
                 f"(profiled own us/step): {heaviest or 'none'}")
    return lines


def reducer_cost_figures(d: Any) -> dict[str, Any] | None:
    """``benchmarks/reducer_host_cost.py``'s figures: each variant's ms per step and what it adds over the floor."""
    if not d or not d.get("variants"):
        return None
    return {"parameters": d.get("parameters"), "elements": d.get("elements"), "ranks": d.get("ranks"),
            "device": d.get("device"),
            "variants": {name: {k: v.get(k) for k in ("label", "wall_ms", "cpu_ms", "added_wall_ms", "added_cpu_ms")}
                         for name, v in d["variants"].items()},
            "gpucomm_added_over_ddp_added": d.get("gpucomm_added_over_ddp_added"),
            "reducer_ran": (d.get("reducer") or {}).get("verified"), "counters_per_step": d.get("counters_per_step")}


def summarize_reducer_cost(step: Step) -> list[str]:
    """The reducer's own host work per step (issue 35), on a model whose backward costs nothing: what each
    variant adds over the no-comm floor, and gpucomm's added time as a share of DDP-best's."""
    f = reducer_cost_figures(step.data)
    if f is None:
        return []
    v = f["variants"]
    order = [n for n in ("gpucomm", "ddp-default", "ddp-best", "no-comm") if n in v]

    def row(key: str) -> str:
        return " | ".join(f"{v[n].get('label') or n} {fmt(v[n].get(key), '.3f')}" for n in order)

    share = f.get("gpucomm_added_over_ddp_added") or {}
    ran = {True: "ran (its counters moved)", False: "did NOT run (no counter moved)"}.get(f.get("reducer_ran"), "n/a")
    return [f"{f['parameters']} parameters (ResNet-50's, scaled down to {f['elements']} elements: host work only), "
            f"{f['ranks']} rank(s), {f['device']}: wall ms/step {row('wall_ms')}",
            f"added over no-comm, wall ms/step: {row('added_wall_ms')}; CPU: {row('added_cpu_ms')}",
            f"gpucomm / ddp-best added {fmt(share.get('ddp-best'), '.2f')}, / ddp-default {fmt(share.get('ddp-default'), '.2f')}"
            f" (target <= 0.5 of ddp-best's); one-rank reducer {ran}"]


SUMMARIES: dict[str, Callable[[Step], list[str]]] = {"gpu tests": summarize_tests, "pack_bw": summarize_pack,
                                                     "finite check 2 ranks": summarize_finite_check,
                                                     "step profile 1 rank": summarize_step_profile,
                                                     "reducer host cost 1 rank": summarize_reducer_cost}


def summary_lines(step: Step) -> list[str]:
    """The step's figures in a few lines ([] when it left no results)."""
    fn = SUMMARIES.get(step.name)
    if fn is None:
        fn = (summarize_collectives if step.name.startswith("collectives")
              else summarize_resnet50 if step.name.startswith("resnet50") else summarize_train)
    try:
        return fn(step)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError) as e:
        return [f"(could not summarize: {type(e).__name__}: {e})"]


def summary_text(steps: list[Step], header: str) -> str:
    lines = [header, f"{'step':<28} {'status':<22} {'s':>6}  figures"]
    for step in steps:
        figures = summary_lines(step) or [""]
        seconds = f"{step.seconds:>6.0f}" if step.seconds else f"{'-':>6}"
        lines.append(f"{step.name:<28} {step.status:<22} {seconds}  {figures[0]}")
        lines += [f"{'':<28} {'':<22} {'':>6}  {f}" for f in figures[1:]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the machine and stack


def _guard(fn: Callable[[], Any]) -> Any:
    """``fn()``, or {"error": ...} when it raises: one missing piece never loses the rest."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return {"error": f"{type(e).__name__}: {e}"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(code: int) -> str:
    """CUDA's version integer (1000 * major + 10 * minor) as ``major.minor``."""
    return f"{code // 1000}.{(code % 1000) // 10}"


def device_facts() -> dict[str, Any]:
    """Every CUDA device torch sees: name, memory, compute capability, multiprocessors."""
    import torch  # noqa: PLC0415

    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / (1 << 30), 1),
                        "compute_capability": f"{p.major}.{p.minor}",
                        "multiprocessors": getattr(p, "multi_processor_count", None)})
    return {"count": len(devices), "devices": devices}


def driver_facts() -> dict[str, Any]:
    """The NVIDIA driver's version and its CUDA API version, from NVML, else from nvidia-smi."""
    try:
        import pynvml  # noqa: PLC0415 - package nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return {"version": _text(pynvml.nvmlSystemGetDriverVersion()),
                    "cuda_api": _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion()), "source": "NVML"}
        finally:
            pynvml.nvmlShutdown()
    except Exception as nvml_error:  # noqa: BLE001 - try nvidia-smi, then say why neither answered
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True)
            return {"version": r.stdout.strip().splitlines()[0], "cuda_api": None, "source": "nvidia-smi"}
        except Exception as smi_error:  # noqa: BLE001
            return {"error": f"NVML: {type(nvml_error).__name__}: {nvml_error}; "
                             f"nvidia-smi: {type(smi_error).__name__}: {smi_error}"}


def cuda_facts() -> dict[str, Any]:
    """The CUDA version torch was built for, CuPy's runtime and the driver's, and NCCL's (CuPy's and torch's)."""
    import torch  # noqa: PLC0415

    def torch_nccl() -> str:
        v = torch.cuda.nccl.version()  # (major, minor, patch); an int in old releases
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

    out: dict[str, Any] = {"torch_built_for": torch.version.cuda, "torch_nccl": _guard(torch_nccl)}

    def cupy_side() -> dict[str, Any]:
        import cupy.cuda.runtime as runtime  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        from gpucomm.backends.nccl import version_text  # noqa: PLC0415

        return {"cupy_runtime": _cuda_version(runtime.runtimeGetVersion()),
                "driver_api": _cuda_version(runtime.driverGetVersion()),
                "nccl": version_text(nccl.get_version())}

    side = _guard(cupy_side)
    out.update(side if "error" not in side else {"cupy_side": side})
    return out


DISTRIBUTIONS = ("torch", "torchvision", "cupy", "numba", "numba-cuda", "numpy", "nvidia-ml-py", "cuda-bindings",
                 "nvidia-nccl-cu13", "nvidia-nccl-cu12", "gpucomm", "pytest")


def stack_versions() -> dict[str, str | None]:
    """Python and each package's installed version (None: not installed); CuPy under whichever wheel
    (cupy-cuda13x, cupy-cuda12x, cupy) provides it."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    provides = importlib.metadata.packages_distributions()
    for name in DISTRIBUTIONS:
        dists = provides.get("cupy", []) + ["cupy"] if name == "cupy" else [name]
        out[name] = None
        for dist in dists:
            try:
                out[name] = importlib.metadata.version(dist) + (f" ({dist})" if dist != name else "")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if out["gpucomm"] is None:  # run from a source tree that was never installed
        out["gpucomm"] = _guard(lambda: __import__("gpucomm").__version__ + " (source tree)")
    return out


def commit_facts(given: str | None) -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it (git); ``given`` (--commit) when
    this tree is a copy without .git, or beside git's answer when the two differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError) as e:
        if given:
            return {"sha": given, "dirty": None, "source": "--commit (no git checkout here)"}
        return {"sha": None, "dirty": None, "source": f"unknown: git failed ({type(e).__name__}); pass --commit SHA"}
    out: dict[str, Any] = {"sha": sha, "dirty": dirty, "source": "git"}
    if given and not sha.startswith(given) and not given.startswith(sha):
        out["given"] = given
    return out


def environment(commit: str | None) -> dict[str, Any]:
    """The machine and software the run measured (each part guarded: a missing one reads as an error)."""
    now = datetime.datetime.now().astimezone()
    return {"date": now.date().isoformat(), "started": now.isoformat(timespec="seconds"),
            "host": platform.node(), "platform": platform.platform(), "gpus": _guard(device_facts),
            "driver": _guard(driver_facts), "cuda": _guard(cuda_facts), "versions": _guard(stack_versions),
            "commit": commit_facts(commit)}


def gpu_slug(name: str, count: int) -> str:
    """A folder-name form of the GPU: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3" ("2x-..." for two)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = re.sub(r"^nvidia-", "", slug) or "gpu"
    return f"{count}x-{slug}" if count > 1 else slug


def results_folder(date: str, slug: str, base: Path = RESULTS) -> Path:
    """``base/<date>-<slug>``, with -2, -3, ... when a run of that day and GPU is already there."""
    folder, n = base / f"{date}-{slug}", 2
    while (folder / "summary.json").exists():
        folder, n = base / f"{date}-{slug}-{n}", n + 1
    return folder


# ----------------------------------------------------------------------------- summary.json and summary.md


def build_summary(steps: list[Step], env: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The committed record: the run (command, budget, time), the environment, every step's status and
    figure lines, every GPU test's outcome, and the figures with their anchors."""
    by_name = {s.name: s for s in steps}
    tests = by_name["gpu tests"].data if "gpu tests" in by_name else None
    return {
        "schema": SCHEMA, "tool": "benchmarks/verify_gpu.py", **run, "environment": env,
        "steps": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 1), "figures": summary_lines(s)}
                  for s in steps],
        "gpu_tests": tests,
        "figures": {
            "resnet50": [f for s in steps if s.name.startswith("resnet50")
                         for f in [resnet50_figures(s)] if f is not None],
            "pack_bw": pack_figures(by_name["pack_bw"].data) if "pack_bw" in by_name else None,
            "collectives": [f for s in steps if s.name.startswith("collectives")
                            for f in [collectives_figures(s.data)] if f is not None],
            "train": [row for s in steps if s.name.startswith("train") for row in train_figures(s)],
            "finite_check": by_name["finite check 2 ranks"].data if "finite check 2 ranks" in by_name else None,
            "step_profile": step_profile_figures(by_name["step profile 1 rank"].data)
            if "step profile 1 rank" in by_name else None,
            "reducer_host_cost": reducer_cost_figures(by_name["reducer host cost 1 rank"].data)
            if "reducer host cost 1 rank" in by_name else None,
        },
        "raw": f"{RAW}/ beside this file (not committed): every log, full JSON, plot and the junit XML",
    }


def _md(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return out + [""]


def _err(part: Any) -> str | None:
    return part["error"] if isinstance(part, dict) and "error" in part else None


def _fact(part: Any, show: Callable[[Any], str]) -> str:
    """A recorded fact as text: "not recorded" when missing, the error when it could not be had."""
    if part is None or part == {}:
        return "not recorded"
    return f"n/a ({_err(part)})" if _err(part) else show(part)


STATE_NOTES = {"interrupted": ", interrupted (Ctrl-C)",
               "running": ", NOT finished: the run was still going, or was killed, after the steps shown"}


def markdown(doc: dict[str, Any]) -> str:
    """summary.md: the same facts as summary.json, as tables a reviewer reads top to bottom."""
    env = doc.get("environment") or {}
    gpus = env.get("gpus") or {}
    commit = env.get("commit") or {}
    devices = gpus.get("devices") or []
    title = (f"{gpus.get('count', 0)} x {devices[0]['name']}" if devices else "no GPU facts")
    lines = [f"# gpucomm GPU verification, {env.get('date', 'date unknown')}: {title}", ""]
    dirty = {True: "tracked files modified", False: "clean tree", None: "tree state unknown"}[commit.get("dirty")]
    lines += [f"Commit `{commit.get('sha') or 'unknown'}` ({dirty}; {commit.get('source', 'n/a')})"
              + (f", but --commit said `{commit['given']}`" if commit.get("given") else "") + ".  ",
              f"Command: `{doc.get('command', 'n/a')}`; {fmt(doc.get('seconds'), '.0f')} s of a "
              f"{fmt(doc.get('budget_s'), '.0f')} s budget" + STATE_NOTES.get(doc.get("state"), "") + ".  ",
              f"Full results: `{RAW}/` beside this file (not committed).", "", "## Machine and stack", ""]
    lines += _table(["item", "value"], machine_rows(env))
    lines += ["## Steps", ""]
    lines += _table(["step", "status", "s", "figures"],
                    [[s["name"], s["status"], fmt(s["seconds"] or None, ".0f"), "<br>".join(s["figures"]) or "-"]
                     for s in doc.get("steps") or []])
    lines += _tests_md(doc.get("gpu_tests"))
    figures = doc.get("figures") or {}
    lines += _resnet_md(figures.get("resnet50") or [])
    lines += _pack_md(figures.get("pack_bw"))
    lines += _collectives_md(figures.get("collectives") or [])
    lines += _train_md(figures.get("train") or [])
    return "\n".join(lines).rstrip() + "\n"


def machine_rows(env: dict[str, Any]) -> list[list[str]]:
    """The machine and stack as (item, value) rows; a part that could not be read shows why."""
    gpus, driver, cuda, versions = (env.get(k) or {} for k in ("gpus", "driver", "cuda", "versions"))

    def gpu_text(d: dict[str, Any]) -> str:
        return f"{d['name']}, {d['memory_gib']} GiB, compute capability {d['compute_capability']}"

    def driver_text(d: dict[str, Any]) -> str:
        return f"{d.get('version')} (CUDA API {d.get('cuda_api') or 'n/a'}, from {d.get('source')})"

    def cuda_text(c: dict[str, Any]) -> str:
        text = (f"torch built for {c.get('torch_built_for')}, CuPy runtime {c.get('cupy_runtime', 'n/a')}, "
                f"driver API {c.get('driver_api', 'n/a')}")
        return text + (f" (CuPy: {c['cupy_side']['error']})" if "cupy_side" in c else "")

    def nccl_text(c: dict[str, Any]) -> str:
        return f"{c.get('nccl', 'n/a')} (CuPy), {_fact(c.get('torch_nccl'), str)} (torch)"

    rows = [[f"GPU {d['index']}", gpu_text(d)] for d in gpus.get("devices") or []]
    rows = rows or [["GPUs", _fact(gpus, lambda _: "none seen")]]
    rows += [["NVIDIA driver", _fact(driver, driver_text)], ["CUDA", _fact(cuda, cuda_text)],
             ["NCCL", _fact(cuda, nccl_text)]]
    if versions and not _err(versions):
        return rows + [[name, v if v is not None else "not installed"] for name, v in versions.items()]
    return rows + [["versions", _fact(versions, str)]]


def _tests_md(tests: dict[str, Any] | None) -> list[str]:
    lines = ["## GPU tests (`pytest -m gpu`)", ""]
    if not tests:
        return lines + ["No results: the step did not run or left neither its junit XML nor its log.", ""]
    c = tests["counts"]
    lines += [f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped, "
              f"{c['xfailed']} xfailed (from the {tests['source']}).", ""]
    bad = [t for t in tests["cases"] if t["outcome"] in ("failed", "error")]
    if bad:
        lines += _table(["test", "outcome", "message"], [[f"`{t['id']}`", t["outcome"], t["message"]] for t in bad])
    lines += ["<details><summary>every test</summary>", ""]
    lines += _table(["test", "outcome"], [[f"`{t['id']}`", t["outcome"] + (f": {t['message']}" if t["message"]
                                                                           and t["outcome"] == "skipped" else "")]
                                          for t in tests["cases"]])
    return lines + ["</details>", ""]


def _run_notes(r: dict[str, Any]) -> list[str]:
    """The lines under a run's table: added time, sockets, the reducer, the fusion path."""
    notes = [added_line(r["added_over_floor"])]
    notes += [t for t in (sockets_text(r["nccl_sockets"]), reducer_text(r["one_rank_reducer"])) if t]
    if r["fusion_asked"] is not None:
        notes.append(f"fusion asked: {r['fusion_asked']}"
                     + (" (GPUCOMM_FUSION_KERNELS=0)" if r["fusion_asked"] == "fallback" else "")
                     + (" (GPUCOMM_GRADIENT_VIEWS=0)" if r["fusion_asked"] == "packed" else "")
                     + f"; path that ran: {r['fusion_path'] or 'n/a'}, kernels compiled {fmt(r['compiled_kernels'])}, "
                       f"kernel_fallbacks {fmt(r['kernel_fallbacks'])}; "
                       f"as asked: {'yes' if r['path_verified'] else 'NO'}")
    notes += [t for t in (zero_grad_text(r),) if t]
    per_step = (r.get("gradient_path") or {}).get("per_step")
    if per_step:
        notes.append("gpucomm per timed step: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in per_step.items()))
    return [n + "  " for n in notes] + [""]


def _resnet_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## ResNet-50: gpucomm's DistributedOptimizer beside DDP-default, DDP-best and no communication", ""]
    if not rows:
        return lines + ["No results.", ""]
    lines += ["Every variant interleaved in one job (`benchmarks/optimizer_vs_ddp.py`, balanced round order, the same "
              "warm-up and weights): the median of the rounds' median step, wall time (slowest rank) and process CPU "
              "time (every thread, mean of the ranks), with the rounds' quartiles; ratios are round by round. "
              "ddp-default is DDP at its defaults, ddp-best has `gradient_as_bucket_view=True, static_graph=True`; "
              "neither broadcasts buffers (gpucomm does not). The fusion path is rank 0's "
              "`gpucomm.kernels.status()` and `hvd.stats()['kernel_fallbacks']` after training.", ""]
    for r in rows:
        lines += [f"### {r['run']} (batch {fmt(r['batch_per_rank'])} per rank)", ""]
        lines += _table(["variant", "wall ms/step", "round IQR", "CPU ms/step", "round IQR", "img/s", "vs ddp-best",
                         "vs ddp-default"],
                        [[v["label"], fmt(v["wall_ms"], ".1f"), fmt_pair(v["wall_quartiles_ms"], ".1f"),
                          fmt(v["cpu_ms"], ".1f"), fmt_pair(v["cpu_quartiles_ms"], ".1f"),
                          fmt(v["images_per_s"], ".0f"), fmt(v["vs_ddp_best"], ".3f"), fmt(v["vs_ddp_default"], ".3f")]
                         for v in r["variants"].values()])
        lines += _run_notes(r)
    return lines


def _pack_md(pack: dict[str, Any] | None) -> list[str]:
    lines = ["## Pack / unpack against one device-to-device copy (`benchmarks/pack_bw.py`)", ""]
    if not pack:
        return lines + ["No results.", ""]
    if pack.get("skipped"):
        return lines + [f"Skipped: {pack['skipped']}", ""]
    lines += _table(["case", "op", "d2d GB/s (anchor)", "kernel GB/s", "kernel % d2d", "fallback % d2d",
                     "torch.cat/copy_ % d2d", "kernel host us"],
                    [[r["case"], r["op"], fmt(r["d2d_gbps"], ".0f"), fmt(r["kernel_gbps"], ".0f"),
                      fmt(r["kernel_pct_of_d2d"], ".1f"), fmt(r["fallback_pct_of_d2d"], ".1f"),
                      fmt(r["cat_split_pct_of_d2d"], ".1f"), fmt(r["kernel_host_us"], ".1f")] for r in pack["rows"]])
    if pack.get("targets"):
        lines += _table(["target (issue 17)", "met"], [[k, "yes" if v else "NO"] for k, v in pack["targets"].items()])
    return lines


def _collectives_md(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["## Collectives: gpucomm beside raw NCCL and torch.distributed (`benchmarks/collectives.py`)", "",
             "Out-of-place calls, then the in-place calls where Horovod's API has them (allreduce_, broadcast_); "
             "ratios are gpucomm / other (time: above 1 is slower; bandwidth: below 1 is slower).", ""]
    if not runs:
        return lines + ["No results.", ""]
    for run in runs:
        where = "sharing one GPU, NCCL over loopback sockets" if run["single_gpu_test"] else "one GPU each"
        lines += [f"### {run['ranks']} rank(s), {where}: #wrong {run['wrong']}"
                  + (" (interrupted: rows so far)" if run["interrupted"] else ""), ""]
        notes = [f"Not measured: {k}: {v}" for k, v in run["not_measured"].items()]
        notes += [t for t in [sockets_text(run.get("nccl_sockets"))] if t]
        moved = ", ".join(f"{k} {v}" for k, v in (run.get("gpucomm_counters") or {}).items())
        notes += [f"gpucomm counters moved by its timed calls (rank 0): {moved}"] if moved else []
        lines += [n + "  " for n in notes] + ([""] if notes else [])
        head = ["collective", "size", "gpucomm", "nccl", "torch", "gpucomm/nccl", "gpucomm/torch"]
        for key, unit, spec in (("latency_us", "us per call", ".1f"),
                                ("bandwidth_gbps", f"{run['metric']} GB/s", ".2f"),
                                ("in_place_latency_us", "in-place, us per call", ".1f")):
            if not run.get(key):
                continue
            lines += [f"{unit}:", ""]
            lines += _table(head, [[r["collective"], size_text(r["bytes"]), fmt(r["gpucomm"], spec),
                                    fmt(r["nccl"], spec), fmt(r["torch"], spec), fmt(r["gpucomm_vs_nccl"], ".3f"),
                                    fmt(r["gpucomm_vs_torch"], ".3f")] for r in run[key]])
    return lines


def _train_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Training throughput (`benchmarks/train.py`)", ""]
    if not rows:
        return lines + ["No results.", ""]
    lines += ["The same four variants, interleaved; samples/s for the whole job, ms and CPU ms per step, ratios of "
              "throughput round by round, scaling efficiency against the 1-rank run of the same variant.", ""]
    table_rows = [[r["ranks"], r["model"], v["label"], fmt(v["samples_per_s"], ".1f"), fmt(v["wall_ms"], ".2f"),
                   fmt(v["cpu_ms"], ".2f"), fmt(v["vs_ddp_best"], ".3f"), fmt(v["vs_ddp_default"], ".3f"),
                   fmt(v["vs_no_comm"], ".3f"), fmt(v["scaling_efficiency"], ".2f")]
                  for r in rows for v in r["variants"].values()]
    lines += _table(["ranks", "model", "variant", "samples/s", "ms/step", "CPU ms/step", "vs ddp-best",
                     "vs ddp-default", "vs no-comm", "scaling eff."], table_rows)
    for r in rows:
        notes = [added_line(r["added_over_floor"])]
        notes += [t for t in (sockets_text(r["nccl_sockets"]), reducer_text(r["one_rank_reducer"])) if t]
        lines += [f"{r['ranks']} rank(s), {r['model']}: " + "; ".join(notes), ""]
    return lines


def write_summary(out: Path, steps: list[Step], text: str, env: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """summary.txt (the printed table), summary.json and summary.md; returns the JSON document."""
    doc = build_summary(steps, env, run)
    (out / "summary.txt").write_text(text + "\n")
    write_json(str(out / "summary.json"), doc)
    (out / "summary.md").write_text(markdown(doc))
    return doc


def git_add_line(out: Path) -> str:
    """The command that commits the summary (a folder outside the checkout must be copied in first)."""
    try:
        rel = out.resolve().relative_to(ROOT)
    except ValueError:
        return (f"# {out} is outside the checkout: copy {' and '.join(COMMITTED)} into "
                f"benchmarks/results/<date>-<gpu>/, then git add them")
    return "git add " + " ".join(str(rel / name) for name in COMMITTED)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help="folder for the summary and raw/ (default bench-out)")
    where.add_argument("--results", action="store_true",
                       help="use benchmarks/results/<YYYY-MM-DD>-<gpu>, the folder whose summary is committed")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run (default 540: 9 minutes)")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps and runs (a smoke run)")
    ap.add_argument("--commit", metavar="SHA", help="the commit this tree is, recorded when it has no .git")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their commands, run nothing")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: print and write the summary of the results already in --out")
    args = ap.parse_args(argv)
    if args.dry_run and args.summarize_only:
        ap.error("--dry-run and --summarize-only exclude each other; give one")
    if args.summarize_only and args.results:
        ap.error("--summarize-only needs the folder to read: give --out benchmarks/results/<date>-<gpu>")
    if args.budget <= 0:
        ap.error(f"--budget {args.budget:g}: give a positive number of seconds")
    return args


def print_plan(steps: list[Step], gpus: int, out: Path, budget: float) -> None:
    """--dry-run: the output folder, every step's limit, environment and command (for 1 GPU when none
    is visible here)."""
    print(f"verify_gpu: plan for {max(gpus, 1)} GPU(s){'' if gpus else ' (none visible here: assumed 1)'}, "
          f"budget {budget:.0f} s, output in {out} (summary.json, summary.md; logs and full results in {RAW}/)")
    for step in steps:
        env = "".join(f"{k}={v} " for k, v in step.env.items())
        print(f"{step.name:<28} limit {step.timeout:>4.0f} s  {env}{' '.join(step.argv[1:])}")


def choose_out(args: argparse.Namespace, gpus: int) -> Path:
    """--out, or (--results) benchmarks/results/<today>-<gpu>, or bench-out."""
    if args.results:
        slug = gpu_slug(gpu_name(), gpus) if gpus else "GPU-NAME"
        return results_folder(datetime.date.today().isoformat(), slug)
    return Path(args.out or "bench-out").resolve()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/verify_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    gpus = 0 if args.summarize_only else gpu_count()  # summarizing needs no GPU (and no torch import)
    if args.dry_run:
        out = choose_out(args, gpus)
        print_plan(plan(out, max(gpus, 1), args.quick), gpus, out, args.budget)
        return 0
    if gpus == 0 and not args.summarize_only:
        print("verify_gpu: no CUDA GPU visible to torch; run this on a GPU machine (or --dry-run / "
              "--summarize-only, which need none).", file=sys.stderr)
        return 2
    out = choose_out(args, gpus)
    (out / RAW).mkdir(parents=True, exist_ok=True)
    steps = plan(out, max(gpus, 1), args.quick)
    if args.summarize_only:
        return summarize_only(out, steps)
    env = environment(args.commit)
    write_json(str(out / RAW / "environment.json"), env)
    run: dict[str, Any] = {"command": command, "budget_s": args.budget, "quick": args.quick, "seconds": 0.0,
                           "state": "running"}
    device = gpu_name()
    print(f"verify_gpu: {gpus} x {device}; output in {out}", flush=True)
    t0 = time.monotonic()

    def record() -> str:
        run["seconds"] = round(time.monotonic() - t0, 1)
        header = (f"# gpucomm GPU verification: {gpus} x {device}, {run['seconds']:.0f} s in all"
                  + ("" if run["state"] == "finished" else f" ({run['state']})"))
        text = summary_text(steps, header)
        write_summary(out, steps, text, env, run)
        return text

    record()
    finished = run_steps(steps, out, args.budget, after_step=record)
    run["state"] = "finished" if finished else "interrupted"
    text = record()
    print("\n" + text)
    print(f"\nwrote {out / 'summary.md'} and summary.json; to commit them:\n  {git_add_line(out)}")
    if not finished:
        return 130
    return 0 if all(s.status == "ok" for s in steps) else 1


def summarize_only(out: Path, steps: list[Step]) -> int:
    """--summarize-only: the summary of what a run left in ``out`` (its environment, when recorded)."""
    read_existing(steps, out)
    env_file = out / RAW / "environment.json"
    env = json.loads(env_file.read_text()) if env_file.exists() else {}
    old = out / "summary.json"
    run = {"command": "n/a", "budget_s": None, "quick": None, "seconds": None, "state": None}
    if old.exists():
        try:
            run.update({k: v for k, v in json.loads(old.read_text()).items() if k in run})
        except ValueError:
            pass
    text = summary_text(steps, f"# gpucomm GPU verification, summary of the results in {out}")
    print(text)
    write_summary(out, steps, text, env, run)
    return 0


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
