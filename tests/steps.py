"""Tests that run in a CI step of their own rather than in the README's test command: they are
selected by their marker (``pytest -m NAME``) or by ``GPUCOMM_TEST_NAME=1``, and skip, saying how
to run them, otherwise. The newcomer's command stays under 8 minutes on 2 cores; CI runs them all."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

# marker -> how its CI step runs it
STEPS = {
    "e2e": "`python -m pytest -m e2e -n 2 --dist loadfile` (.ci/run's e2e step): whole jobs run end to end "
           "(the benchmarks, the documented commands, the Kubernetes pods' environments, the elastic stress jobs, the examples)",
}


def selected(config: Any, marker: str) -> bool:
    """Whether this pytest run asked for ``marker``'s tests (``-m`` naming it, not as ``not MARKER``; or
    ``GPUCOMM_TEST_<MARKER>=1``)."""
    expr = config.getoption("markexpr", "") or ""
    return bool(re.search(rf"(?<!not )\b{re.escape(marker)}\b", expr)) \
        or os.environ.get(f"GPUCOMM_TEST_{marker.upper()}") == "1"


def require_step(config: Any, marker: str) -> None:
    """Skip the calling test (or fixture), saying how to run it, unless ``marker``'s step was asked for."""
    if not selected(config, marker):
        pytest.skip(f"runs in its own CI step: {STEPS[marker]}")


__all__ = ["STEPS", "require_step", "selected"]
