"""Elastic jobs that finish must report success: a stress run of the scenario that used to fail at
teardown (issue 26, item 7).

A 3-worker elastic job on three loopback "hosts" (127.0.0.1-3) trains ``tests/ranks/elastic_job.py``; once
it has 3 ranks, rank 0 removes one host from the discovery file, the job re-forms with 2 and
finishes. Before the fix a survivor could die at the very end (``gloo::IoException ... Connection
closed by peer``, SIGABRT, or SIGSEGV) when the removed worker tore down its side of an earlier
round's Gloo group, and ``gpucomm-run`` exited 1 although training had finished. Each run must exit
0, write its result, and match one process trained on the same batches; the script counts false
failures (exit != 0 with a result written) and real ones.

    python benchmarks/elastic_stress.py [--runs 20] [--remove 127.0.0.3:1] [--json elastic_stress.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_stats import write_json  # noqa: E402


def one_run(workdir: Path, remove: str, kill: str, timeout: float) -> dict:
    hosts = workdir / "hosts.txt"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n")
    out = workdir / "out"
    out.mkdir()
    env = dict(os.environ, ELASTIC_OUT=str(out), ELASTIC_HOSTS_FILE=str(hosts), ELASTIC_MODE="sampler",
               ELASTIC_EPOCHS="3", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if kill:  # a worker dies: the survivors' old round fails (its Gloo groups are abandoned, not shut down)
        env["ELASTIC_KILL"] = kill
    else:  # discovery drops a host: the old round closes cleanly
        env["ELASTIC_REMOVE"] = f"3@{remove}"
    cmd = [sys.executable, "-m", "gpucomm.runner", "-np", "3", "--min-np", "2", "--host-discovery-script",
           f"cat {hosts}", sys.executable, str(ROOT / "tests" / "ranks" / "elastic_job.py")]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else \
            (e.stderr or "")
    result_file = out / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    signals = [line for line in stderr.splitlines()
               if any(k in line for k in ("SIGABRT", "SIGSEGV", "IoException", "terminate called", "Traceback"))]
    return {"exit": code, "seconds": round(time.monotonic() - t0, 2), "result": result is not None,
            "sizes": result["sizes"] if result else None, "signals": signals[:5],
            "tail": stderr.splitlines()[-6:] if code != 0 else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--remove", default="127.0.0.3:1", help="the host (as listed) that discovery drops at size 3")
    ap.add_argument("--kill", default="", help="instead, SIGKILL this worker at a step (e.g. 127.0.0.3:0@4)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", default="elastic_stress.json")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="gpucomm-elastic-stress-") as tmp:
            run = one_run(Path(tmp), args.remove, args.kill, args.timeout)
        runs.append(run)
        verdict = "ok" if run["exit"] == 0 and run["result"] else ("FALSE FAILURE" if run["result"] else "FAILED")
        print(f"run {i + 1:>3}: exit {run['exit']}, {run['seconds']:6.1f} s, sizes {run['sizes']}: {verdict}"
              + (f"  {run['signals'][:2]}" if run["signals"] else ""), flush=True)
    false = sum(1 for r in runs if r["exit"] != 0 and r["result"])
    failed = sum(1 for r in runs if not r["result"])
    shrank = sum(1 for r in runs if r["sizes"] and 3 in r["sizes"] and r["sizes"][-1] == 2)
    how = f"killing {args.kill}" if args.kill else f"removing {args.remove}"
    print(f"# {args.runs} runs of a 3-worker elastic job shrinking to 2 ({how}): {false} false failures (finished, reported "
          f"failure), {failed} real failures (no result), {shrank} runs shrank as planned")
    write_json(args.json, {"runs": runs, "false_failures": false, "failures": failed, "shrank": shrank,
                           "scenario": how})


if __name__ == "__main__":
    main()
