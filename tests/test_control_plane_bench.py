"""benchmarks/control_plane.py, benchmarks/mismatch_exit.py and benchmarks/timeline_overhead.py with
tiny counts on 2 CPU ranks: they run, print their tables on rank 0 only, and write sane JSON (and
PNGs); plus the timeline analysis on a hand-made trace."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.launcher_util import PYTHON, ROOT, launcher_cmd, run

PREFIX = "[0]<stdout>:"


def _load(name: str):
    """benchmarks/ is not a package: load a script by path, once, as ``benchmarks_<name>``."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def test_control_plane_quick_run_reports_latency_bursts_and_mismatch(tmp_path):
    js = tmp_path / "cp.json"
    r = run(launcher_cmd("-np", "2", PYTHON, "benchmarks/control_plane.py", "--rounds", "2", "--iters", "20",
                         "--warmup", "5", "--burst-repeats", "3", "--mismatch-repeats", "1", "--json", str(js)),
            timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.leftovers == []
    assert "[1]<stdout>" not in r.stdout  # only rank 0 reports
    assert f"{PREFIX}wrote {js}" in r.stdout
    doc = json.loads(js.read_text())
    assert doc["benchmark"] == "control_plane" and doc["ranks"] == 2
    assert doc["generations"]["default"]["inline_bytes"] == 16 << 10
    assert doc["generations"]["inline_off"]["inline_bytes"] == 0

    lat = doc["latency"]
    assert set(lat) == {"named", "unnamed", "named_dataplane", "barrier", "raw_gloo", "named_4097", "raw_gloo_4097"}
    for name, s in lat.items():
        assert 0 < s["p10_us"] <= s["median_us"] <= s["p90_us"] < 1e6, (name, s)
        assert 0 < s["loop_avg_us"] < 1e6, (name, s)
        # raw Gloo: both generations each round; the others: one block per round
        assert s["blocks"] == (4 if name == "raw_gloo" else 2) and s["ops"] == 20 * s["blocks"], (name, s)
        if name.startswith("raw_gloo"):
            assert s["control_rounds_per_op"] == 0, (name, s)  # raw Gloo never talks to the coordinator
        else:
            assert s["control_rounds_per_op"] >= 1, (name, s)  # a blocking op is at least one round
        assert f"{PREFIX}{name:>16} " in r.stdout
    for name, ratio in doc["ratios"].items():
        assert ratio["vs"] == ("raw_gloo_4097" if name == "named_4097" else "raw_gloo")
        for stat in ("loop_avg", "median"):
            assert math.isfinite(ratio[stat]) and ratio[stat] > 0, (name, ratio)

    bursts = doc["bursts"]
    assert set(bursts) == {"inline_1", "dataplane_5000", "inline_off_1"}
    # 100 async ops share a few control rounds: at most one leaves per cycle while the burst is being
    # submitted, and one more for the rest when it is synchronized (a loaded machine submits slower)
    cycle_ms = doc["generations"]["default"]["cycle_time_ms"]
    assert bursts["inline_1"]["cached"]["rounds_median"] <= 5, bursts["inline_1"]
    for kind, b in bursts.items():
        assert b["uncached"]["bursts"] == 2 and b["cached"]["bursts"] == 6, (kind, b)
        for label in ("uncached", "cached"):
            assert b[label]["ms_median"] > 0
            for rounds, submit_ms in zip(b[label]["rounds_all"], b[label]["submit_ms_all"]):
                assert 1 <= rounds <= submit_ms / cycle_ms + 3, (kind, label, b)
                assert rounds < 50, (kind, label, b)  # batched: far fewer rounds than ops

    m = doc["mismatch"]
    assert m["repeats"] == 2 and [p["rank"] for p in m["per_rank"]] == [0, 1]
    assert all(0 < p["max_ms"] < 10_000 for p in m["per_rank"])
    assert "Mismatched ALLREDUCE" in m["error"] and "rank 0 sent [1]; rank 1 sent [2]" in m["error"]
    assert m["all_errors_name_shapes"]


def test_uncaught_mismatch_ends_every_rank_quickly(tmp_path):
    js = tmp_path / "exit.json"
    # the benchmark's own verdict uses 2 s; a loaded test machine gets 10 (Python's teardown alone takes ~0.5 s)
    r = run([PYTHON, "benchmarks/control_plane.py", "--mismatch-exit", "--exit-repeats", "1", "--exit-limit", "10",
             "--json", str(js)], timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.leftovers == []
    doc = json.loads(js.read_text())
    assert doc["benchmark"] == "mismatch_exit" and doc["ok"] is True
    (launch,) = doc["runs"]
    assert launch["returncode"] != 0 and not launch["hung"] and not launch["not_reached"]
    assert launch["ranks_called"] == [0, 1] and launch["ranks_with_error"] == [0, 1]
    ends = launch["call_to_rank_process_end_s"]
    assert set(ends) == {"0", "1"} and all(0 <= t < 10 for t in ends.values()), ends
    assert 0 <= launch["call_to_launcher_exit_s"] < 10
    assert launch["launch_to_call_s"] < launch["launch_to_all_ranks_exited_s"] <= launch["launch_to_launcher_exit_s"]
    assert doc["limit_s"] == 10 and "every rank raised the error and exited within 10 s of the call: yes" in r.stdout
    assert all(0 <= t < 10 for t in launch["call_to_rank_exit_hook_s"].values())  # error + gpucomm shutdown


def test_mismatch_exit_mode_refuses_to_run_under_a_launcher(tmp_path):
    r = run(launcher_cmd("-np", "1", PYTHON, "benchmarks/control_plane.py", "--mismatch-exit",
                         "--json", str(tmp_path / "x.json")), timeout=60)
    assert r.returncode != 0 and "run it with plain python" in r.stdout + r.stderr
    assert not (tmp_path / "x.json").exists()


def test_timeline_overhead_quick_run_writes_json_and_pngs(tmp_path):
    out = tmp_path / "tl"
    r = run(launcher_cmd("-np", "2", PYTHON, "benchmarks/timeline_overhead.py", "--pairs", "1", "--steps-per-block",
                         "2", "--warmup", "1", "--batch-size", "8", "--out", str(out)), timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.leftovers == []
    assert "[1]<stdout>" not in r.stdout
    doc = json.loads((out / "timeline_overhead.json").read_text())
    assert doc["benchmark"] == "timeline_overhead" and doc["ranks"] == 2 and doc["model"] == "convnet"
    assert doc["steps_per_mode"] == 2
    assert doc["step_ms"]["off_median"] > 0 and doc["step_ms"]["on_median"] > 0
    assert math.isfinite(doc["overhead_pct"]) and f"{PREFIX}timeline overhead: " in r.stdout
    # the default limits split convnet into the head (first bucket, <= 1 MiB) and the rest
    assert list(doc["buckets"].values()) == [1029024, 2602240]
    last = doc["last_timeline"]
    assert last["steps"] == 2 and last["open_optimizer_spans"] == 0
    assert 0 <= last["overlap_ms"] <= min(last["backward_ms"], last["gloo_allreduce_busy_ms"]) + 1e-9
    assert 0 <= last["hidden_fraction"] <= 1
    assert [b["path"] for b in last["buckets"]] == ["GLOO_ALLREDUCE", "GLOO_ALLREDUCE"]
    assert all(b["reductions"] == 2 for b in last["buckets"])
    for key in ("png", "png_step"):
        assert doc[key] and open(doc[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert (out / "timeline.0.json").is_file()


# -- the timeline analysis, without a job ------------------------------------------------------


def _trace(spans):
    """Records for spans [(pid, name, label, start_us, end_us)] plus process names."""
    names = {pid: name for pid, name, *_ in spans}
    recs = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": n}} for pid, n in names.items()]
    for pid, _, label, a, b in spans:
        recs += [{"ph": "B", "name": label, "ts": a, "pid": pid}, {"ph": "E", "ts": b, "pid": pid}]
    return recs


def test_analysis_measures_overlap_and_explains_a_single_late_bucket(tmp_path):
    bench = _load("timeline_overhead")
    b0, b1, bw = "DistributedOptimizer.bucket.0", "DistributedOptimizer.bucket.1", "DistributedOptimizer.backward"
    # two steps: backward 0-100 ms; bucket 0 reduced 20-50 ms (inside), bucket 1 at 110-130 ms (after)
    spans = []
    for t in (0, 1000_000):
        spans += [(3, bw, "BACKWARD", t, t + 100_000),
                  (1, b0, "NEGOTIATE_ALLREDUCE", t + 15_000, t + 20_000),
                  (1, b0, "GLOO_ALLREDUCE", t + 20_000, t + 50_000),
                  (2, b1, "GLOO_ALLREDUCE", t + 110_000, t + 130_000)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace(spans)))
    a = bench.analyse(str(path), {b0: 1000, b1: 2000})
    assert a["steps"] == 2 and a["overlap_ms"] == pytest.approx(60.0)
    assert a["gloo_allreduce_busy_ms"] == pytest.approx(100.0) and a["hidden_fraction"] == pytest.approx(0.6)
    by = {b["bucket"]: b for b in a["buckets"]}
    assert by[b0]["start_minus_backward_end_ms_median"] == pytest.approx(-80.0)
    assert by[b0]["negotiate_ms_median"] == pytest.approx(5.0)
    assert by[b1]["start_minus_backward_end_ms_median"] == pytest.approx(10.0)
    assert by[b1]["allreduce_ms_median"] == pytest.approx(20.0) and by[b1]["negotiate_ms_median"] is None
    notes = bench.diagnosis(a)
    assert len(notes) == 2 and b1 in notes[0] and "after backward" in notes[0]
    assert notes[1].startswith(f"{b0}: negotiation median 5.00 ms")

    # one bucket, reduced only after backward: nothing hidden, and the notes say why
    path.write_text(json.dumps(_trace([(3, bw, "BACKWARD", 0, 100_000), (1, b0, "GLOO_ALLREDUCE", 101_000, 120_000)])))
    single = bench.analyse(str(path), {b0: 889_000})
    assert single["overlap_ms"] == 0 and single["hidden_fraction"] == 0
    notes = bench.diagnosis(single)
    assert any(n.startswith("one bucket") for n in notes) and any("near zero" in n for n in notes)

    # a bucket the coordinator reduced inline has no Gloo span
    path.write_text(json.dumps(_trace([(3, bw, "BACKWARD", 0, 100_000),
                                       (1, b0, "COORDINATOR_REDUCE", 10_000, 10_000)])))  # zero length, as written
    tiny = bench.analyse(str(path), {b0: 4000})
    assert tiny["hidden_fraction"] is None and tiny["inline_bucket_reductions"] == 1
    assert any("GPUCOMM_INLINE_BYTES" in n for n in bench.diagnosis(tiny))


def test_percentile_picks_nearest_rank():
    bench = _load("control_plane")
    values = [float(i) for i in range(100)]
    assert bench.percentile(values, 0.1) == 10.0 and bench.percentile(values, 0.9) == 90.0
    assert bench.percentile([5.0], 0.9) == 5.0 and bench.percentile(values, 1.0) == 99.0
