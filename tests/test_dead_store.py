"""A dead store host ends the job fast (issue 26, item 4): in a job launched by hand, rank 0 serves
the rendezvous store; when it is SIGKILLed mid-training, the survivors name the cause at once and
exit, instead of retrying the dead store in shutdown for GPUCOMM_START_TIMEOUT (set to 300 s here,
so a survivor that still retried would outlive the test's 60 s limit and fail it)."""

from __future__ import annotations

import re

from tests.harness import run_rank_scripts


def _stamp(text: str, what: str) -> float | None:
    m = re.search(rf"{what} ([0-9.]+)", text)
    return float(m.group(1)) if m else None


def test_survivors_of_a_dead_store_host_exit_with_the_cause():
    ranks = run_rank_scripts(["-m", "tests.ranks.dead_store_program"], 3, timeout=60, store_on_rank0=True,
                             env={"GPUCOMM_START_TIMEOUT": "300", "GPUCOMM_TIMEOUT": "300"})
    assert ranks[0].returncode == -9, ranks[0].stderr[-2000:]
    killed = _stamp(ranks[0].stderr, "KILLED_AT")
    for r in (1, 2):
        res = ranks[r]
        assert res.returncode not in (0, None) and "[harness] rank killed" not in res.stderr, res.stderr[-3000:]
        assert "rank 0" in res.stderr and ("closed" in res.stderr or "stopped" in res.stderr), res.stderr[-3000:]
        exited = _stamp(res.stderr, "EXIT_AT")
        assert exited is not None, res.stderr[-3000:]
        print(f"rank {r}: exited {exited - killed:.2f} s after rank 0 was killed")
    assert all(res.leftovers == [] for res in ranks)
