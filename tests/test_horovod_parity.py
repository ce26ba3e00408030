"""Horovod names and behaviours a migrating script relies on (issue 19, first part)."""

from __future__ import annotations

import pytest

from tests import parity_scenarios as scenarios
from tests.harness import run_ranks


@pytest.mark.parametrize("size", [2, 3])
def test_is_homogeneous_and_barriers_on_process_sets(size):
    results = run_ranks(scenarios.homogeneous_and_set_barriers, size, timeout=120, env={"GPUCOMM_TIMEOUT": "60"})
    assert [r["homogeneous"] for r in results] == [True] * size  # one host, every rank on it
    assert [r["total"] for r in results] == [float(size)] * size
