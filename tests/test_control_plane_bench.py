"""benchmarks/control_plane.py, benchmarks/mismatch_exit.py and benchmarks/timeline_overhead.py without
a job: their summaries of 1-rank, empty and partial measurements, the timeline analysis on a hand-made
trace, and the refusals. The scripts themselves run in tests/test_benchmarks_smoke.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.harness import ROOT


def _load(name: str):
    """benchmarks/ is not a package: load a script by path, once, as ``benchmarks_<name>``."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def test_mismatch_exit_mode_refuses_to_run_under_a_launcher(tmp_path, monkeypatch, capsys):
    bench = _load("control_plane")
    args = bench.parse_args(["--mismatch-exit", "--quick", "--json", str(tmp_path / "x.json")])
    monkeypatch.setenv("GPUCOMM_RANK", "0")  # what every rank of a gpucomm-run job has
    with pytest.raises(SystemExit, match="run it with plain python"):
        bench.mismatch_exit(args)
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        bench.parse_args(["--mismatch-exit", "--np", "1"])
    assert "a shape mismatch needs at least 2 ranks" in capsys.readouterr().err


# -- summaries of 1-rank, empty and partial measurements, without a job ---------------------------


def _local(bench, iters: int, bursts: int, mismatches: int, plane: bool = True):
    """One rank's measurements for one round: every variant, ``bursts`` bursts of each kind; with no
    control plane (a 1-rank job) no frames are counted."""
    local = bench.Local()
    for v in bench.VARIANTS:
        local.blocks[v], local.ops[v] = [iters * 1e-4], [1e-4] * iters
        if plane:
            local.frames[v] = [iters]
    for kind in bench.BURSTS:
        local.bursts[kind] = [{"cached": i > 0, "frames": 2 if plane else None, "submit_s": 1e-3, "seconds": 2e-3}
                              for i in range(bursts)]
    local.mismatch = [1e-3] * mismatches
    local.mismatch_errors = ["Mismatched ALLREDUCE tensor shapes"] * mismatches
    return local


def _result(bench, every, args):
    return {"ranks": len(every), "args": vars(args), "loadavg_1min": {"before": 0.0, "after": 0.0},
            "generations": {"default": {"inline_bytes": 16384, "cycle_time_ms": 1.0},
                            "inline_off": {"inline_bytes": 0, "cycle_time_ms": 1.0}},
            **bench.summarize(every, args)}


def test_control_plane_summary_at_one_rank_and_with_nothing_cached():
    bench = _load("control_plane")
    args = bench.parse_args(["--quick", "--burst-repeats", "0"])
    one = _result(bench, [_local(bench, 20, bursts=1, mismatches=0, plane=False)], args)
    assert one["mismatch"]["not_measured"] == "a shape mismatch needs at least 2 ranks"
    assert all(set(b) == {"uncached"} for b in one["bursts"].values())  # no cached burst was run
    assert one["latency"]["named"]["control_rounds_per_op"] is None and one["latency"]["named"]["ops"] == 20
    assert one["bursts"]["inline_1"]["uncached"]["rounds_median"] is None
    lines = bench.table(one)
    assert lines[-2:] == ["# mismatched shapes: not measured (a shape mismatch needs at least 2 ranks)",
                          "# note: control rounds n/a: a 1-rank job has no control plane (gpucomm runs its "
                          "collectives inline)"]
    assert any(line.split()[:3] == ["inline_1", "n/a", "n/a"] for line in lines), lines
    counted = _result(bench, [_local(bench, 20, bursts=1, mismatches=0)], args)
    assert any(line.split()[:3] == ["inline_1", "2", "n/a"] for line in bench.table(counted))

    two = _result(bench, [_local(bench, 20, 2, 1), _local(bench, 20, 2, 1)], bench.parse_args(["--quick"]))
    assert [p["rank"] for p in two["mismatch"]["per_rank"]] == [0, 1] and two["mismatch"]["not_measured"] is None
    assert two["latency"]["named"]["ops"] == 20 and two["ratios"]["named"]["median"] == pytest.approx(1.0)

    empty = bench.Local()  # a rank that measured nothing: every figure is None, the table says n/a
    nothing = _result(bench, [empty, empty], bench.parse_args(["--quick", "--mismatch-repeats", "0"]))
    assert nothing["latency"]["named"]["median_us"] is None and nothing["ratios"]["named"]["median"] is None
    assert nothing["mismatch"]["not_measured"] == "--mismatch-repeats 0"
    assert "n/a" in "\n".join(bench.table(nothing))


def test_mismatch_exit_summary_with_no_launch_or_a_hung_one():
    bench = _load("control_plane")
    args = bench.parse_args(["--mismatch-exit", "--quick"])
    none = bench.exit_summary([], args)
    assert none["ok"] is False and none["call_to_last_rank_exit_s_median"] is None
    assert "no launch finished: n/a" in bench.exit_table(none)
    hung = {"returncode": -9, "hung": True, "ranks_called": [0, 1], "ranks_with_error": [], "launch_to_call_s": 1.0,
            "launch_to_all_ranks_exited_s": None, "launch_to_launcher_exit_s": 60.0, "call_to_rank_exit_hook_s": {},
            "call_to_rank_process_end_s": {0: 0.5}, "call_to_launcher_exit_s": 59.0, "not_reached": False}
    result = bench.exit_summary([hung], args)
    assert result["ok"] is False and result["call_to_last_rank_exit_s_max"] is None
    assert bench.exit_table(result)[-1].endswith(": NO (slowest rank: median n/a s, max n/a s)")


def test_timeline_summary_at_one_rank_and_with_an_unreadable_timeline(tmp_path):
    bench = _load("timeline_overhead")
    times = {"off": [0.02], "on": [0.03]}
    s = bench.summarize(times, [times], steps_per_block=1)
    assert s["step_ms"]["off_quartiles"] is None and s["overhead_pct"] == pytest.approx(50.0)
    bad = tmp_path / "t.json"
    bad.write_text("[{")  # a file cut short
    broken = bench.safe_analyse(str(bad), {"DistributedOptimizer.bucket.0": 4})
    assert broken["error"]
    assert bench.overlap_notes(2, [broken])[0].startswith("no timeline could be analysed (")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_trace([])))
    one_rank = bench.safe_analyse(str(empty), {"DistributedOptimizer.bucket.0": 4})
    assert one_rank["steps"] == 0 and one_rank["hidden_fraction"] is None
    assert "at 1 rank DistributedOptimizer reduces nothing" in bench.overlap_notes(1, [one_rank])[0]
    result = {"model": "cnn", "parameters": 1, "ranks": 1, "threads_per_rank": 1, "batch_size": 8, "buckets": {},
              "args": {"pairs": 1, "steps_per_block": 1}, "loadavg_1min": {"before": 0.0, "after": 0.0}, **s,
              "last_timeline": None, "all_timelines": {"overlap_ms": 0.0, "gloo_allreduce_busy_ms": 0.0,
                                                       "hidden_fraction": None, "hidden_fraction_per_timeline": []},
              "diagnosis": bench.overlap_notes(2, [broken]), "png": None}
    lines = bench.table(result)
    assert "# last timeline: not analysed (see the notes)" in lines and lines[2].split()[-1] == "-"


def test_timeline_bucket_plan_survives_the_optimizers_private_layout_changing():
    from types import SimpleNamespace as NS

    import torch

    bench = _load("timeline_overhead")
    bucket = NS(plan=NS(index=0, numel=10, dtype=torch.float32))
    want = {"DistributedOptimizer.bucket.0": 40}
    assert bench.bucket_plan(NS(_buckets=[bucket])) == want  # a list of buckets
    assert bench.bucket_plan(NS(_buckets=NS(buckets=[bucket]))) == want  # an object holding them
    assert bench.bucket_plan(NS(_buckets=NS())) == {} and bench.bucket_plan(object()) == {}
    analysis = {"buckets": [], "hidden_fraction": None}
    assert bench.overlap_notes(2, [analysis])[0].startswith("per-bucket figures n/a: the optimizer's bucket plan")


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
