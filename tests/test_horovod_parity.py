"""Horovod names and behaviours a migrating script relies on (issue 19, first part)."""

from __future__ import annotations

import pytest

from tests.ranks import parity_scenarios as scenarios
from tests.harness import run_ranks


@pytest.mark.parametrize("size", [2, 3])
def test_is_homogeneous_and_barriers_on_process_sets(size):
    results = run_ranks(scenarios.homogeneous_and_set_barriers, size, timeout=120, env={"GPUCOMM_TIMEOUT": "60"})
    assert [r["homogeneous"] for r in results] == [True] * size  # one host, every rank on it
    assert [r["total"] for r in results] == [float(size)] * size


@pytest.mark.parametrize("size", [2, 3])
def test_grouped_allgather_gradient_matches_allgather(size):
    results = run_ranks(scenarios.grouped_allgather_gradients, size, timeout=120)
    for rank, r in enumerate(results):
        assert r["has_grad_fn"] == [True, True], rank
        assert r["shapes"] == [[rank + 1, 3], [2, 3]]
        assert r["grouped"] == r["single"], rank


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_on_ranks_outside_its_process_set(size):
    results = run_ranks(scenarios.optimizer_on_non_members, size, timeout=120, env={"GPUCOMM_TIMEOUT": "60"})
    # Members 0 and 1 average the gradients (1 and 2, per weight element): 1.5 per step, three steps.
    for rank in (0, 1):
        assert results[rank]["weight"] == pytest.approx([1 - 3 * 1.5] * 2)
    # Rank 2 is outside the set: plain local steps with its own gradient 3.
    if size == 3:
        assert results[2]["weight"] == pytest.approx([1 - 3 * 3.0] * 2)


@pytest.mark.parametrize("size", [2, 3])
def test_zero_grad_guard_and_step_after_synchronize_warning(size):
    for r in run_ranks(scenarios.optimizer_guards, size, timeout=120):
        assert r["zero_grad"] is True  # refused with Horovod's message, although no bucket was launched
        assert r["warning"] == [True]
