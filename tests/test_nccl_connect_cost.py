"""benchmarks/nccl_connect_cost.py without a GPU: its plan, its skip, and the arithmetic of its
summary on made-up readings (the GPU run itself belongs to a GPU session)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.harness import PYTHON, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "nccl_connect_cost.py"


def load():
    spec = importlib.util.spec_from_file_location("nccl_connect_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_plan_and_touches_no_gpu():
    r = run([PYTHON, str(SCRIPT), "--dry-run", "--ranks", "3", "--communicators", "5", "--sizes", "8,4096"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "# 5 communicators of 3 rank(s)" in r.stdout
    assert "allreduce 8 B, allreduce 4096 B, reducescatter 4092 B, allgather 1364 B" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    out = tmp_path / "cost.json"
    r = run([PYTHON, str(SCRIPT), "--quick", "--json", str(out)], timeout=60)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "nccl_connect_cost" and doc["skipped"] and doc["modes"] == {}


def test_summary_counts_each_gpu_once_and_takes_the_slowest_rank():
    bench = load()
    mib = 1 << 20
    # two ranks on GPU 0 (each reads the same device), readings: start, 2 creations, 2 first, 2 second passes
    shared = [1000 * mib, 990 * mib, 980 * mib, 950 * mib, 920 * mib, 920 * mib, 920 * mib]
    records = [{"rank": r, "device": 0, "connects_lazily": True, "free_bytes": shared,
                "create_s": [0.1 + r, 0.2], "first_pass_s": [0.5, 0.6 + r], "second_pass_s": [0.01, 0.02]}
               for r in (0, 1)]
    s = bench.summarize(records, 2)
    assert s["per_communicator"]["create_mib"] == [10.0, 10.0]  # not doubled by the second rank's reading
    assert s["per_communicator"]["first_pass_mib"] == [30.0, 30.0]
    assert s["per_communicator"]["create_s"] == [1.1, 0.2] and s["per_communicator"]["first_pass_s"] == [0.5, 1.6]
    assert s["total_mib_per_communicator"] == 40.0 and s["connects_lazily"] == [True]
    # one GPU per rank: both GPUs count
    records[1] = dict(records[1], device=1)
    assert bench.summarize(records, 2)["per_communicator"]["create_mib"] == [20.0, 20.0]


def test_calls_split_evenly_over_the_ranks():
    bench = load()
    calls = bench.collectives([8, 100], 3)
    assert calls == [("allreduce", 2), ("allreduce", 25), ("reducescatter", 24), ("allgather", 8)]
    assert bench.placement(2, 1)[1] == [0, 0] and bench.placement(2, 4)[1] == [0, 1]
