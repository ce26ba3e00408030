"""Issue 18's hardening: in-place collectives and autograd, argument errors, checkpoint leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from tests import hardening_scenarios as scenarios
from tests.harness import run_ranks


def test_in_place_collectives_bump_versions_and_refuse_leaves():
    run_ranks(scenarios.check_in_place_collectives_behave_like_torch_in_place_ops, 2, timeout=120)


def test_non_tensors_and_bad_ops_are_named():
    run_ranks(scenarios.check_bad_arguments_name_what_is_accepted, 2, timeout=120)


def test_save_checkpoint_sweeps_temporaries_of_killed_writers(tmp_path):
    """Writers SIGKILLed mid-write leave their temporary files; the next save removes them (and only them)."""
    target = tmp_path / "ckpt.pt"
    writer = textwrap.dedent(f"""
        import torch
        from gpucomm.torch.checkpoint import save_checkpoint
        print("writing", flush=True)
        save_checkpoint({{"w": torch.zeros(64 << 20, dtype=torch.uint8)}}, {str(target)!r})
    """)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".ckpt.pt.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    left = sorted(tmp_path.glob(".ckpt.pt.*.tmp"))
    assert left, "the killed writers left nothing to sweep (they finished first)"
    foreign = tmp_path / ".ckpt.pt.other-host.1.abc.tmp"  # another host's writer, sharing the directory
    foreign.write_bytes(b"x")
    from gpucomm.torch.checkpoint import save_checkpoint

    assert save_checkpoint({"v": 1}, target)
    assert sorted(tmp_path.glob(".ckpt.pt.*.tmp")) == [foreign]
    assert torch.load(target) == {"v": 1}


def test_a_collective_type_mismatch_under_one_name_raises_on_every_rank():
    for size, gatherers in ((2, (1,)), (3, (1,))):
        results = run_ranks(scenarios.collective_type_clash, size, args=(gatherers,), timeout=120,
                            env={"GPUCOMM_TIMEOUT": "120"})
        print(f"{size} ranks: mismatch raised after {[round(r['elapsed'], 2) for r in results]} s")
        for rank, r in enumerate(results):
            assert r["outcome"].startswith("CollectiveError") or "Mismatched collective types" in r["outcome"], r
            assert "Mismatched collective types under the name 'm'" in r["outcome"], (rank, r["outcome"])
            assert "called allreduce" in r["outcome"] and "rank 1 called allgather" in r["outcome"], r["outcome"]
            assert r["elapsed"] < 60, r  # a hang bound (GPUCOMM_TIMEOUT is 120 s); about 1-2 s expected
            size_rows = 2 * size
            assert sorted(r["crossed"]) == sorted([(2,), (size_rows,)]), r["crossed"]
