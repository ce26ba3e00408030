"""The one-command GPU verification run, checked without a GPU: its plan uses flags the scripts
accept, it shares one GPU through the single-GPU test mode, it refuses to run without a GPU, and its
summary reads the real JSON the benchmarks write."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.launcher_util import PYTHON, ROOT, launcher_cmd, run

sys.path.insert(0, str(ROOT / "benchmarks"))
import verify_gpu  # noqa: E402


def _accepted_flags(script: str) -> set[str]:
    text = subprocess.run([PYTHON, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


def test_plan_uses_existing_scripts_and_flags(tmp_path):
    steps = verify_gpu.plan(tmp_path, gpus=1, quick=False)
    names = [s.name for s in steps]
    assert names == ["gpu tests", "pack_bw", "collectives 1 rank(s)", "train 1 rank", "collectives 2 rank(s)",
                     "train 2 ranks", "collectives 4 rank(s)"]
    for step in steps[1:]:
        script = next(a for a in step.argv if a.startswith("benchmarks/"))
        assert (ROOT / script).exists()
        flags = _accepted_flags(script)
        used = [a for a in step.argv[step.argv.index(script) + 1:] if a.startswith("-")]
        assert set(used) <= flags, (script, set(used) - flags)
        n = int(step.argv[step.argv.index("-np") + 1]) if "-np" in step.argv else 1
        assert ("--single-gpu-test" in step.argv) == (n > 1), step.argv  # one GPU: ranks share it
    assert all("--single-gpu-test" not in s.argv for s in verify_gpu.plan(tmp_path, gpus=4, quick=False))
    assert "-m" in steps[0].argv and "gpu" in steps[0].argv  # pytest -m gpu


def test_a_silent_hanging_step_is_stopped_at_its_limit(tmp_path):
    import time

    step = verify_gpu.Step("hang", [PYTHON, "-c", "import time; time.sleep(120)"], 2.0)
    t0 = time.monotonic()
    verify_gpu.run_step(step, tmp_path, budget_left=100.0)
    assert step.status == "timed out (2 s)" and time.monotonic() - t0 < 20


def test_refuses_to_run_without_a_gpu():
    r = subprocess.run([PYTHON, "benchmarks/verify_gpu.py", "--out", "/tmp/verify-none"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr


def test_summary_reads_real_benchmark_json(tmp_path):
    coll = tmp_path / "collectives.json"
    r = run(launcher_cmd("-np", "2", PYTHON, "benchmarks/collectives.py", "--device", "cpu", "--ops", "allreduce",
                         "-b", "1M", "-e", "2M", "-w", "1", "-n", "2", "--json", str(coll), "--plot", ""), timeout=120)
    assert r.returncode == 0, r.stderr
    step = verify_gpu.Step("collectives 2 rank(s)", [], 1, coll)
    step.data = __import__("json").loads(coll.read_text())
    lines = verify_gpu.summary_lines(step)
    assert lines[0] == "#wrong over all collectives and sizes: 0"
    assert any(line.startswith("allreduce busbw gpucomm/torch at >= 1 MiB: min ") for line in lines), lines

    train = tmp_path / "train.json"
    r = run(launcher_cmd("-np", "1", PYTHON, "benchmarks/train.py", "--device", "cpu", "--quick", "--models", "cnn",
                         "--json", str(train)), timeout=120)
    assert r.returncode == 0, r.stderr
    step = verify_gpu.Step("train 1 rank", [], 1, train)
    step.data = __import__("json").loads(train.read_text())
    (line,) = verify_gpu.summary_lines(step)
    assert re.match(r"cnn: gpucomm [0-9.]+ vs DDP [0-9.]+ samples/s total, ratio [0-9.]+ .*gpucomm/plain [0-9.]+", line)
