"""Rank functions that probe the test harness itself (``tests/test_harness.py``)."""

from __future__ import annotations

import os


def fail_on_purpose() -> None:
    """Fails, so the pool replaces this slot's warm process: the next task there starts a new one."""
    raise RuntimeError("fails on purpose: this slot's warm process is replaced")


def environment_variable(name: str) -> str | None:
    """This rank process's value of ``name``."""
    return os.environ.get(name)
