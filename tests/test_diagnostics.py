"""Issue 8: the timeline of a real 2-rank CPU run, first-cause error reporting when a rank dies
mid-training, the launcher's diagnostics flags, and rank-prefixed logging."""

from __future__ import annotations

import json
import re

from tests.harness import PYTHON, launcher_cmd, run
from gpucomm.runner.cli import build_parser, tunables_env
from gpucomm.timeline import plot as timeline_plot


def _job(name: str, *extra: str, env: dict | None = None, np: int = 2, timeout: float = 120.0):
    return run(launcher_cmd("-np", str(np), PYTHON, "-m", "tests.ranks.diag_programs", name, *extra),
               env=env, timeout=timeout)


def test_timeline_of_a_training_run_shows_negotiation_buckets_and_backward(tmp_path):
    """The metric allreduce is negotiated; the optimizer's buckets are not (fixed schedule)."""
    path = tmp_path / "timeline.json"
    res = _job("train", env={"GPUCOMM_TIMELINE": str(path)})
    assert res.returncode == 0, res.stderr
    assert not res.leftovers
    records = json.loads(path.read_text())  # closed at shutdown: plain valid JSON
    names = {r["args"]["name"] for r in records if r.get("name") == "process_name" and "name" in r.get("args", {})}
    assert "allreduce.metric" in names
    assert any(n.startswith("DistributedOptimizer.bucket.") for n in names)
    assert "DistributedOptimizer.backward" in names
    labels = [r.get("name") for r in records]
    for label in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "GLOO_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "BACKWARD",
                  "NEGOTIATE_BROADCAST"):
        assert label in labels, label
    # CPU float32 buckets are direct: gradients become views of the fusion buffer, nothing is unpacked
    assert "MEMCPY_OUT_FUSION_BUFFER" not in labels
    bucket_pids = {r["pid"] for r in records if r.get("name") == "process_name"
                   and r.get("args", {}).get("name", "").startswith("DistributedOptimizer.bucket.")}
    assert not any(r.get("name", "").startswith("NEGOTIATE") and r.get("pid") in bucket_pids for r in records), \
        "optimizer buckets run on a fixed schedule: never negotiated"
    ticks = {r["name"] for r in records if r.get("ph") == "X"}
    assert ticks == {"0", "1"}, ticks  # a negotiation tick per rank
    ends = [r for r in records if r.get("ph") == "E" and "args" in r]
    assert any(e["args"].get("dtype") == "float32" and re.fullmatch(r"\[\d+\]", e["args"]["shape"]) for e in ends)
    assert all("tid" not in r for r in records)
    trace = timeline_plot.load_trace(str(path))
    assert timeline_plot.busy_ms(trace, ("DistributedOptimizer.bucket.*", "GLOO_ALLREDUCE")) > 0
    summary = timeline_plot.render(str(path), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["n_rows"] >= 4


def test_start_and_stop_timeline_at_runtime(tmp_path):
    path = tmp_path / "dyn.json"
    res = _job("dynamic_timeline", str(path))
    assert res.returncode == 0, res.stderr
    records = json.loads(path.read_text())  # stop_timeline closed it: valid JSON
    pids = {r["args"]["name"]: r["pid"] for r in records if r.get("name") == "process_name" and r["pid"] > 0}
    assert "allreduce.during" in pids and "allgather.gathered" in pids
    # ops that ran entirely outside the recording window have no op records (a peer's early
    # request for "after" may show up as a negotiation tick, which is what happened then)
    ran = {r["pid"] for r in records if r.get("ph") == "B" and r.get("name") == "ALLREDUCE"}
    assert pids["allreduce.during"] in ran
    assert pids.get("allreduce.after") not in ran


def test_a_rank_dying_mid_training_ends_the_job_with_its_error_everywhere():
    # GPUCOMM_TIMEOUT far above the bound: ending within it proves the failure spread, not a timeout
    res = _job("die_mid_training", timeout=120, env={"GPUCOMM_TIMEOUT": "600"})
    assert res.returncode == 1, res.stderr
    assert not res.leftovers
    # rank 0 names rank 1's exception, not a generic connection error
    assert re.search(r"\[0\]<stderr>:.*rank 1 failed: ValueError: corrupt batch 3 on rank 1", res.stdout + res.stderr)
    # the launcher names rank 1's error as the job's cause, whichever rank happened to exit first
    assert re.search(r"rank 1 (failed with|on \S+ failed first:) ValueError: corrupt batch 3 on rank 1", res.stderr)
    # the failing rank's traceback is printed once by the launcher's summary
    assert res.stderr.count("last ") == 1


def test_verbose_shows_setup_steps_with_timings_and_rank_prefixes():
    res = run(launcher_cmd("--verbose", "-np", "2", PYTHON, "examples/hello_allreduce.py"), timeout=120)
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    for rank in (0, 1):
        assert re.search(rf"gpucomm rank {rank} INFO gpucomm: init: all 2 ranks arrived in \d+\.\d+ s", text), text
        assert re.search(rf"gpucomm rank {rank} INFO gpucomm: init: control plane connected in", text)


def test_launcher_exports_control_plane_and_timeline_flags():
    args = build_parser().parse_args([
        "-np", "2", "--stall-check-warning-time-seconds", "5", "--stall-check-shutdown-time-seconds", "20",
        "--cycle-time-ms", "2.5", "--cache-capacity", "0", "--timeline-filename", "t.json", "--timeline-mark-cycles",
        "python", "x.py"])
    env = tunables_env(args, {})
    assert env["GPUCOMM_STALL_CHECK_TIME_SECONDS"] == env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5"
    assert env["GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS"] == "20"
    assert env["GPUCOMM_CYCLE_TIME"] == "2.5" and env["GPUCOMM_CACHE_CAPACITY"] == "0"
    assert env["GPUCOMM_TIMELINE"].endswith("t.json") and env["GPUCOMM_TIMELINE_MARK_CYCLES"] == "1"
    off = tunables_env(build_parser().parse_args(["-np", "1", "--no-stall-check", "python", "x.py"]), {})
    assert off["GPUCOMM_STALL_CHECK_DISABLE"] == "1"
