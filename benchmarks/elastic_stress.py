"""Elastic jobs that finish must report success, and no worker may die at teardown: stress runs of
the scenarios that used to fail there (issue 26, item 7; issue 36, finding 8).

Each run trains ``tests/ranks/elastic_job.py`` under ``gpucomm-run`` on loopback "hosts" (127.0.0.x).
Scenarios (``--scenario``):

* ``remove``: 3 workers on 127.0.0.1-3; once the job has 3 ranks rank 0 drops a host (``--remove``) from
  the discovery file; the job re-forms with 2 (the old round closes cleanly) and finishes.
* ``kill``: the same 3 workers; one is SIGKILLed mid-step (``--kill``); the survivors' old round fails.
* ``fault``: Horovod's ``test_fault_tolerance_without_scaling``: ``-H 127.0.0.1:2,127.0.0.2:2`` (the
  hosts never change), 4 workers; worker 127.0.0.1:0 fails mid-step (``--exit-mode``); host 127.0.0.1 is
  blacklisted, so worker 127.0.0.1:1 is removed and exits 0 while the survivors still hold the failed
  round's Gloo pairs to it; the job finishes on 127.0.0.2's two workers.
* ``rank``: Horovod's ``test_single_rank_failure``: the same failure with a discovery script listing
  ``127.0.0.1:2`` and ``127.0.0.2:2`` (``-np 2 --max-np 4``: the job starts with 4).
* ``internal``: 3 workers; one raises ``HorovodInternalError`` once (a fault nobody dies of); the job
  re-forms with the same 3 workers, and they exit normally one after the other at the end while the
  others still hold the failed round's pairs to them.

Before the fix of finding 8 a survivor could die at its own exit (``gloo::IoException ... Connection closed
by peer``, SIGABRT, or SIGSEGV) when a worker it still had a failed round's pairs to exited normally, and
``gpucomm-run`` exited 1 although training had finished. Each run must exit 0 and write its result; the
script counts false failures (exit != 0 with a result written), real ones, and deaths (a worker killed by
SIGABRT/SIGSEGV or a C++ ``terminate``).

    python benchmarks/elastic_stress.py [--scenario fault] [--runs 20] [--exit-mode raise|kill] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_stats import write_json  # noqa: E402

SCENARIOS = ("remove", "kill", "fault", "rank", "internal")
FAILING = "127.0.0.1:0"  # the worker that fails in the fault and rank scenarios
DEATH = re.compile(r"SIGABRT|SIGSEGV|terminate called|IoException")


@dataclass(frozen=True)
class Plan:
    """One scenario's launcher flags, discovery file and fault."""

    flags: list[str]
    hosts: str | None  # the discovery file's text (None: -H in flags)
    env: dict[str, str]
    expect_sizes: tuple[int, int]  # the job's first and last size


def plan(scenario: str, remove: str, kill: str, exit_mode: str) -> Plan:
    """What one run of ``scenario`` launches (see the module's docstring)."""
    three = "127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n"
    fault = {"kill": {"ELASTIC_KILL": f"{FAILING}@5"}, "raise": {"ELASTIC_RAISE": f"{FAILING}@5"}}[exit_mode]
    if scenario == "remove":
        return Plan(["-np", "3", "--min-np", "2"], three, {"ELASTIC_REMOVE": f"3@{remove}"}, (3, 2))
    if scenario == "kill":
        return Plan(["-np", "3", "--min-np", "2"], three, {"ELASTIC_KILL": kill}, (3, 2))
    if scenario == "fault":
        return Plan(["-np", "4", "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:2"], None, fault, (4, 2))
    if scenario == "rank":
        return Plan(["-np", "2", "--min-np", "2", "--max-np", "4"], "127.0.0.1:2\n127.0.0.2:2\n", fault, (4, 2))
    return Plan(["-np", "3", "--min-np", "3"], three, {"ELASTIC_INTERNAL": "127.0.0.2:0@5"}, (3, 3))


def one_run(workdir: Path, p: Plan, timeout: float) -> dict:
    """Launch one elastic job in ``workdir``; its exit, result, and any worker death at teardown."""
    out = workdir / "out"
    out.mkdir()
    env = dict(os.environ, ELASTIC_OUT=str(out), ELASTIC_MODE="sampler", ELASTIC_EPOCHS="3", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1", **p.env)
    flags = list(p.flags)
    if p.hosts is not None:
        hosts = workdir / "hosts.txt"
        hosts.write_text(p.hosts)
        env["ELASTIC_HOSTS_FILE"] = str(hosts)
        flags += ["--host-discovery-script", f"cat {hosts}"]
    job = ROOT / "tests" / "ranks" / "elastic_job.py"
    cmd = [sys.executable, "-m", "gpucomm.runner", *flags, sys.executable, str(job)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = "timeout", e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    result_file = out / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    deaths = [line for line in stderr.splitlines() if DEATH.search(line)]
    return {"exit": code, "seconds": round(time.monotonic() - t0, 2), "result": result is not None,
            "sizes": result["sizes"] if result else None, "deaths": deaths[:5],
            "tail": stderr.splitlines()[-6:] if code != 0 else []}


def compact(sizes: list[int] | None) -> str:
    """``[4, 4, 2, 2, 2]`` as ``4x2 2x3``."""
    if not sizes:
        return "-"
    parts: list[list[int]] = []
    for size in sizes:
        if parts and parts[-1][0] == size:
            parts[-1][1] += 1
        else:
            parts.append([size, 1])
    return " ".join(f"{size}x{count}" for size, count in parts)


def verdict(run: dict) -> str:
    """A death counts first: it is what this benchmark hunts (it also turns a finished job into a failure)."""
    if run["deaths"]:
        return "DEATH"
    if run["exit"] == 0 and run["result"]:
        return "ok"
    return "FALSE FAILURE" if run["result"] else "FAILED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=SCENARIOS, default=None, help="default: remove (kill with --kill)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--remove", default="127.0.0.3:1",
                    help="remove: the host (as listed) that discovery drops at size 3")
    ap.add_argument("--kill", default="", help="kill: SIGKILL this worker at a step (e.g. 127.0.0.3:0@4)")
    ap.add_argument("--exit-mode", choices=("raise", "kill"), default="raise",
                    help=f"fault, rank: how {FAILING} fails (an exception out of training, or SIGKILL)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", default="elastic_stress.json")
    args = ap.parse_args()
    scenario = args.scenario or ("kill" if args.kill else "remove")
    if scenario == "kill" and not args.kill:
        args.kill = "127.0.0.3:0@4"
    p = plan(scenario, args.remove, args.kill, args.exit_mode)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="gpucomm-elastic-stress-") as tmp:
            run = one_run(Path(tmp), p, args.timeout)
        runs.append(run)
        print(f"run {i + 1:>3}: exit {run['exit']}, {run['seconds']:6.1f} s, sizes {compact(run['sizes'])}: "
              f"{verdict(run)}"
              + (f"  {run['deaths'][:2]}" if run["deaths"] else ""), flush=True)
    false = sum(1 for r in runs if r["exit"] != 0 and r["result"])
    failed = sum(1 for r in runs if not r["result"])
    deaths = sum(1 for r in runs if r["deaths"])
    first, last = p.expect_sizes
    shrank = sum(1 for r in runs if r["sizes"] and first in r["sizes"] and r["sizes"][-1] == last)
    how = {"remove": f"removing {args.remove}", "kill": f"killing {args.kill}",
           "internal": "HorovodInternalError on 127.0.0.2:0 (no change of scale)"}.get(
        scenario, f"{scenario}: {FAILING} fails ({args.exit_mode}), its host-mate removed")
    load = os.getloadavg()
    print(f"# {args.runs} runs of a {first}-worker elastic job ending with {last} ({how}): {deaths} with a worker "
          f"death at teardown, {false} false failures (finished, reported failure), {failed} real failures (no "
          f"result), {shrank} runs went {first} -> {last} as planned; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}")
    write_json(args.json, {"runs": runs, "deaths": deaths, "false_failures": false, "failures": failed,
                           "shrank": shrank, "scenario": scenario, "how": how, "loadavg": list(load)})


if __name__ == "__main__":
    main()
