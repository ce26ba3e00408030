"""Misuse and stalls, named on every rank: in-place collectives and autograd, argument errors, a collective
whose type or name differs between ranks, and a rank that stops responding."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time


from tests.ranks import misuse_scenarios as scenarios
from tests.harness import PYTHON, run_ranks, started


def test_in_place_collectives_bump_versions_and_refuse_leaves():
    run_ranks(scenarios.check_in_place_collectives_behave_like_torch_in_place_ops, 2, timeout=120)


def test_non_tensors_and_bad_ops_are_named():
    run_ranks(scenarios.check_bad_arguments_name_what_is_accepted, 2, timeout=120)


def test_a_collective_type_mismatch_under_one_name_raises_on_every_rank():
    for size, gatherers in ((2, (1,)), (3, (1,))):
        results = run_ranks(scenarios.collective_type_clash, size, args=(gatherers,), timeout=120,
                            env={"GPUCOMM_TIMEOUT": "120"})
        print(f"{size} ranks: mismatch raised after {[round(r['elapsed'], 2) for r in results]} s")
        for rank, r in enumerate(results):
            assert r["outcome"].startswith("CollectiveError") or "Mismatched collective types" in r["outcome"], r
            assert "Mismatched collective types under the name 'm'" in r["outcome"], (rank, r["outcome"])
            assert "called allreduce" in r["outcome"] and "rank 1 called allgather" in r["outcome"], r["outcome"]
            size_rows = 2 * size
            assert sorted(r["crossed"]) == sorted([(2,), (size_rows,)]), r["crossed"]


HUNG = textwrap.dedent("""
    import os, sys, time
    import torch
    import gpucomm.torch as hvd
    hvd.init()
    print(f"PID {hvd.rank()} {os.getpid()}", flush=True)
    big = torch.ones(8 << 20)  # 32 MiB: most of each step is the data transfer
    try:
        for step in range(100000):
            hvd.allreduce(big, name="big", op=hvd.Sum)
            print(f"STEP {hvd.rank()} {step}", flush=True)
    except Exception as e:
        print(f"ERROR {hvd.rank()} {time.time():.3f} {e}", flush=True)
        sys.exit(3)
""")


def test_a_stopped_rank_is_named_on_every_other_rank(tmp_path):
    """SIGSTOP one of 3 ranks while they move data: the others fail naming it (liveness heartbeats),
    instead of waiting for GPUCOMM_TIMEOUT with no name."""
    import re

    from tests.harness import launcher_cmd, write_script

    script = write_script(tmp_path, "hung.py", HUNG)
    lines: list[str] = []
    with started(launcher_cmd("-np", "3", "--stop-grace", "2", PYTHON, str(script)), stderr=subprocess.STDOUT,
                 env={"GPUCOMM_LIVENESS_TIMEOUT": "5", "GPUCOMM_TIMEOUT": "600"}, timeout=300) as job:
        proc = job.proc
        pids, steps = {}, 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(pids) < 3 or steps < 6):
            line = proc.stdout.readline()
            lines.append(line)
            if m := re.search(r"PID (\d) (\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
            steps += "STEP" in line
        os.kill(pids[2], signal.SIGSTOP)
        stopped_at = time.time()
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
    text = "".join(lines)
    errors = {int(r): (float(t), msg) for r, t, msg in re.findall(r"ERROR (\d) ([\d.]+) (.*)", text)}
    assert set(errors) >= {0, 1}, text[-3000:]
    for rank in (0, 1):
        assert "rank 2 stopped responding" in errors[rank][1], errors[rank][1]
        assert re.search(r"it was last told to run allreduce\.big|wait for it in allreduce\.big", errors[rank][1])
    named_after = max(errors[r][0] for r in (0, 1)) - stopped_at
    print(f"SIGSTOP -> named error on ranks 0 and 1 after {named_after:.1f} s (liveness timeout 5 s)")


def test_names_that_differ_per_rank_raise_on_every_rank():
    for size in (2, 3):
        results = run_ranks(scenarios.per_rank_names, size, timeout=120, env={"GPUCOMM_TIMEOUT": "120"})
        print(f"{size} ranks: differing names raised after {[round(r['elapsed'], 2) for r in results]} s")
        for rank, r in enumerate(results):
            assert "The ranks wait for collectives that can never complete" in r["outcome"], (rank, r["outcome"])
            assert "rank 0 waits in 'allreduce.grad.0' (submitted by rank 0)" in r["outcome"], r["outcome"]
            assert "rank 1 waits in 'allreduce.grad.7919' (submitted by rank 1)" in r["outcome"], r["outcome"]
            assert r["late"] == size and r["orders"] == [size, size], r


def test_broadcast_object_of_none_on_other_ranks_says_why_it_cannot_meet():
    """Horovod names broadcast_object's collectives after the object's type, so a non-root rank passing None
    never meets the root (Horovod hangs; here the deadlock check ends it): the error says so."""
    for outcome in run_ranks(scenarios.broadcast_object_of_none, 2, timeout=120):
        assert "The ranks wait for collectives that can never complete" in outcome, outcome
        assert "named this broadcast after the object's type" in outcome and "'NoneType'" in outcome, outcome
