"""The one-command GPU verification run, checked without a GPU: its plan passes each script's own
argument parser, it shares one GPU through the single-GPU test mode, it refuses to run without a GPU,
a hanging step is stopped, and its summary survives 1-rank, empty and partial results. The summary of
real benchmark JSON is in tests/test_benchmarks_smoke.py (``--summarize-only``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.harness import PYTHON, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import verify_gpu  # noqa: E402

MIB = 1 << 20


def _load(script: str):
    """A benchmark script as a module (benchmarks/ is not a package), loaded once."""
    name = "verify_plan_" + script.rsplit("/", 1)[-1].removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_plan_passes_each_scripts_own_parser(tmp_path):
    steps = verify_gpu.plan(tmp_path, gpus=1, quick=False)
    names = [s.name for s in steps]
    assert names == ["gpu tests", "pack_bw", "collectives 1 rank(s)", "train 1 rank", "collectives 2 rank(s)",
                     "train 2 ranks", "collectives 4 rank(s)"]
    for step in steps[1:]:
        script = next(a for a in step.argv if a.startswith("benchmarks/"))
        args = _load(script).parse_args(step.argv[step.argv.index(script) + 1:])  # SystemExit on a bad flag
        assert args.json == str(step.json_path)
        n = int(step.argv[step.argv.index("-np") + 1]) if "-np" in step.argv else 1
        assert ("--single-gpu-test" in step.argv) == (n > 1), step.argv  # one GPU: ranks share it
    assert all("--single-gpu-test" not in s.argv for s in verify_gpu.plan(tmp_path, gpus=4, quick=False))
    assert "-m" in steps[0].argv and "gpu" in steps[0].argv  # pytest -m gpu


def test_a_silent_hanging_step_is_stopped_at_its_limit(tmp_path):
    import time

    step = verify_gpu.Step("hang", [PYTHON, "-c", "import time; time.sleep(120)"], 1.0)
    t0 = time.monotonic()
    verify_gpu.run_step(step, tmp_path, budget_left=100.0)
    assert step.status == "timed out (1 s)" and time.monotonic() - t0 < 60  # 60: only a hang fails this


def test_refuses_to_run_without_a_gpu(tmp_path):
    if verify_gpu.gpu_count():
        pytest.skip("checks the no-GPU refusal; a GPU is visible here")
    r = subprocess.run([PYTHON, "benchmarks/verify_gpu.py", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert "no CUDA GPU" in line and "--dry-run" in line


def test_dry_run_and_summary_only_need_no_gpu(tmp_path, capsys):
    assert verify_gpu.main(["--dry-run", "--out", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert "collectives 2 rank(s)" in out and "benchmarks/train.py" in out and not (tmp_path / "plan").exists()
    assert verify_gpu.main(["--summarize-only", "--out", str(tmp_path)]) == 0  # nothing there yet
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert {s["status"] for s in doc["steps"]} == {"no results"} and all(s["figures"] == [] for s in doc["steps"])


def test_an_interrupted_run_summarizes_what_finished(tmp_path, monkeypatch):
    steps = [verify_gpu.Step(f"s{i}", [], 60) for i in range(3)]

    def fake_run(step, out, left):
        if step.name == "s1":
            step.status = "interrupted"
            raise KeyboardInterrupt
        step.status = "ok"

    monkeypatch.setattr(verify_gpu, "run_step", fake_run)
    assert verify_gpu.run_steps(steps, tmp_path, 100.0) is False
    assert [s.status for s in steps] == ["ok", "interrupted", "not run (interrupted)"]


# -- the summary lines, on results of every shape -----------------------------------------------


def _collectives(ranks: int, rows: dict[str, dict[int, float]], metric: str = "busbw", **env) -> verify_gpu.Step:
    results = [{"collective": "allreduce", "impl": impl, "bytes": size,
                "out_of_place": {"algbw": bw if metric == "algbw" else 9.0, "busbw": bw if metric == "busbw" else 0.0,
                                 "wrong": 0},
                "in_place": {}}
               for impl, by_size in rows.items() for size, bw in by_size.items()]
    step = verify_gpu.Step(f"collectives {ranks} rank(s)", [], 1)
    step.data = {"env": {"ranks": ranks, **env}, "results": results}
    return step


def test_one_rank_collectives_compare_algbw_not_the_zero_busbw():
    # the bug: at 1 rank every busbw is 0, no ratio survived, and min() of nothing raised
    step = _collectives(1, {"gpucomm": {MIB: 2.0, 4 * MIB: 4.0}, "torch": {MIB: 4.0, 4 * MIB: 5.0}}, metric="algbw")
    assert verify_gpu.summary_lines(step) == [
        "#wrong over all collectives and sizes: 0",
        "allreduce algbw gpucomm/torch at >= 1 MiB: min 0.500, at 4 MiB 0.800 (4 vs 5 GB/s)"]


def test_collectives_summary_without_comparable_rows():
    both_zero = _collectives(2, {"gpucomm": {MIB: 0.0}, "torch": {MIB: 0.0}})
    assert verify_gpu.summary_lines(both_zero)[1] == "allreduce busbw gpucomm/torch: n/a (torch measured 0 GB/s)"
    small = _collectives(2, {"gpucomm": {4096: 1.0, 32768: 2.0}, "torch": {4096: 2.0, 32768: 4.0}},
                         not_measured={"nccl": "raw NCCL moves CUDA buffers only"})
    assert verify_gpu.summary_lines(small)[1:] == [
        "allreduce gpucomm/nccl: not measured (raw NCCL moves CUDA buffers only)",
        "allreduce busbw gpucomm/torch at 32768 B (the largest size; none >= 1 MiB): 0.500 (2 vs 4 GB/s)"]
    assert verify_gpu.summary_lines(_collectives(2, {})) == [
        "#wrong over all collectives and sizes: 0", "allreduce: gpucomm has no out-of-place allreduce rows: n/a"]
    unchecked = _collectives(2, {"gpucomm": {MIB: 1.0}})
    unchecked.data["results"][0]["out_of_place"]["wrong"] = None  # -c 0
    assert verify_gpu.summary_lines(unchecked) == ["#wrong over all collectives and sizes: 0"]


def test_train_and_pack_summaries_of_partial_results():
    step = verify_gpu.Step("train 1 rank", [], 1)
    step.data = {"models": {"cnn": {"variants": {"gpucomm": {"samples_per_s_total": 10.0}},
                                    "ratio_gpucomm_vs_ddp": {}}}}
    assert verify_gpu.summary_lines(step) == ["cnn: gpucomm 10.0 vs DDP n/a samples/s total, ratio n/a "
                                              "(round quartiles n/a)"]
    pack = verify_gpu.Step("pack_bw", [], 1)
    pack.data = {"benchmark": "pack_bw", "skipped": "needs a CUDA GPU", "rows": [], "targets": {}}
    assert verify_gpu.summary_lines(pack) == ["skipped: needs a CUDA GPU"]
    tests = verify_gpu.Step("gpu tests", [], 1)
    assert verify_gpu.summary_lines(tests) == []  # no junit XML: the step shows its status only
