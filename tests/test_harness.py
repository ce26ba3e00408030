"""The test harness and the suite's guards: a warm rank process starts from the session's environment,
and a test that leaves the pytest process's environment changed fails (``tests/conftest.py``)."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from tests.conftest import environment_changes
from tests.harness import PYTHON, ROOT, RankFailure, run, run_ranks, write_script
from tests.ranks import harness_probes

PROBE = "GPUCOMM_TEST_HARNESS_PROBE"


def test_a_warm_rank_process_starts_from_the_sessions_environment(monkeypatch):
    # slot 1's process is replaced, so the next task there starts one while this test's variable is set
    with pytest.raises(RankFailure, match="fails on purpose"):
        run_ranks(harness_probes.fail_on_purpose, 2, ranks=[1])
    monkeypatch.setenv(PROBE, "set in the pytest process by one test")
    assert run_ranks(harness_probes.environment_variable, 2, args=(PROBE,), ranks=[1]) == [None]
    # what a test hands its ranks still reaches them
    assert run_ranks(harness_probes.environment_variable, 2, args=(PROBE,), ranks=[1],
                     env={PROBE: "given"}) == ["given"]


def test_environment_changes_names_what_was_set_changed_or_removed():
    before = {"A": "1", "B": "2", "PYTEST_CURRENT_TEST": "x"}
    after = {"A": "1", "B": "3", "C": "4", "PYTEST_CURRENT_TEST": "y", "TORCHINDUCTOR_CACHE_DIR": "/tmp/t"}
    assert environment_changes(before, after) == ["B", "C"]
    assert environment_changes(after, before) == ["B", "C"]
    assert environment_changes(before, dict(before)) == []


def test_a_test_that_leaves_the_environment_changed_fails_and_is_undone(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    write_script(tmp_path, "test_leaky.py", textwrap.dedent(f"""
        import os

        def test_1_leaks():
            os.environ["{PROBE}"] = "left behind"

        def test_2_after_it():
            assert "{PROBE}" not in os.environ

        def test_3_monkeypatched(monkeypatch):
            monkeypatch.setenv("{PROBE}", "undone by monkeypatch")
    """))
    r = run([PYTHON, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:xdist", "test_leaky.py"],
            cwd=tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "test_leaky.py::test_1_leaks ERROR" in out, out
    assert f"this test changed the pytest process's environment and left it so: {PROBE} ('left behind')" in out, out
    assert "test_leaky.py::test_2_after_it PASSED" in out, out
    assert "test_leaky.py::test_3_monkeypatched PASSED" in out, out
    assert "3 passed, 1 error" in out, out
    assert r.leftovers == []
