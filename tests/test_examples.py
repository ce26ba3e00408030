"""The examples run as documented (CPU, 2 ranks): whole jobs, in CI's e2e step."""

from __future__ import annotations

import re

import pytest

from tests.harness import PYTHON, launcher_cmd, run
from tests.steps import require_step

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _e2e_step(request):
    require_step(request.config, "e2e")


def test_synthetic_benchmark_prints_horovods_report():
    r = run(launcher_cmd("-np", "2", PYTHON, "examples/synthetic_benchmark.py", "--model", "cnn", "--no-cuda",
                         "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                         "--num-iters", "2", "--fp16-allreduce"), timeout=180)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for line in ("Model: cnn", "Batch size: 8", "Number of CPUs: 2", "Running warmup...", "Running benchmark..."):
        assert f"[0]<stdout>:{line}\n" in out
    assert re.search(r"Iter #1: [0-9.]+ img/sec per CPU", out)
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+ \+-[0-9.]+", out)
    assert "[1]<stdout>" not in out  # only rank 0 reports
    assert r.leftovers == []


def test_elastic_example_runs_with_a_discovery_script():
    r = run(launcher_cmd("-np", "2", "--min-np", "1", "--host-discovery-script",
                         "printf '127.0.0.1:1\\n127.0.0.2:1\\n'", PYTHON, "examples/elastic_train.py",
                         "--epochs", "2"), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "round 1: 2 worker(s) [127.0.0.1:0, 127.0.0.2:0] (job start)" in r.stderr
    assert re.search(r"\[0\]<stdout>:epoch 1: test accuracy [0-9.]+% on 2 worker\(s\)", r.stdout), r.stdout
    assert "[0]<stdout>:final test accuracy" in r.stdout
    assert r.leftovers == []
