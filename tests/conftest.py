"""Suite-wide guard: a test leaves this process's environment as it found it.

The harness's warm rank processes and the commands tests start inherit the pytest process's
environment, so a variable one test sets and leaves (a benchmark's parser run in-process, a bare
``os.environ[...] = ...``) reaches whichever tests xdist happens to run after it in the same worker:
a flaky failure far from its cause (it happened: ``GPUCOMM_ZERO_GRAD_KEEPS_VIEWS``). Each test's
changes are undone after it, and the test that made them fails, naming the variables. Use
``monkeypatch.setenv``/``delenv`` (undone before this check) or an ``env=`` argument of the harness.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest

# set by pytest itself, or lazily by torch: the first time inductor is touched (a cache folder, the same for every
# test), and by torch 2.1's CUDA initialization (CUDA_MODULE_LOADING=LAZY, even where it then finds no GPU)
NOT_LEAKS = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "CUDA_MODULE_LOADING"})


def environment_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The variables set, changed or removed between ``before`` and ``after`` (the allowed ones left out)."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and k not in NOT_LEAKS)


@pytest.fixture(autouse=True)
def _environment_left_as_found() -> Iterator[None]:
    before = dict(os.environ)
    yield
    changed = environment_changes(before, dict(os.environ))
    if not changed:
        return
    described = ", ".join(f"{k} ({'removed' if k not in os.environ else repr(os.environ[k])})" for k in changed)
    for k in changed:  # undone first, so the tests after this one run in the environment they expect
        if k in before:
            os.environ[k] = before[k]
        else:
            os.environ.pop(k, None)
    pytest.fail(f"this test changed the pytest process's environment and left it so: {described}. Later tests in "
                f"this process (and the rank processes and commands they start) would inherit it. Set variables "
                f"with monkeypatch.setenv/delenv or pass them to the harness (env=...).", pytrace=False)
