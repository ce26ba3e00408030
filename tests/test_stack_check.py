"""Ranks started from different installs (gpucomm, torch's release series) fail at init() on every rank, naming
which ranks and hosts run what; a different Python only gets rank 0's warning. One job here mixes two real
virtual environments (torch 2.1 and 2.13) where this checkout has both: CI's torch-range steps."""

from __future__ import annotations

import logging
import platform
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from gpucomm.errors import GpucommError, RoundReplaced
from gpucomm.job.stack_check import check_same_stack, software_stack
from tests.harness import PYTHON, ROOT, run_rank_scripts, write_script


def _records(*stacks: dict, hosts: tuple[str, ...] = ()) -> list[dict]:
    return [{"host": hosts[r] if r < len(hosts) else "node-a", "stack": s} for r, s in enumerate(stacks)]


MINE = {"gpucomm": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7"}


def test_the_same_series_with_other_builds_and_patch_releases_pass(caplog):
    other_build = {**MINE, "torch": "2.13.1+cu130", "python": "3.11.9"}
    with caplog.at_level(logging.WARNING, logger="gpucomm"):
        check_same_stack(_records(MINE, other_build, MINE), rank=0)
    assert caplog.records == []


def test_another_gpucomm_or_torch_series_names_the_ranks_and_hosts():
    records = _records(MINE, MINE, MINE, {**MINE, "torch": "2.1.0+cu121"}, {"gpucomm": "0.0.9", "torch": "2.13.0",
                                                                            "python": "3.11.7"},
                       hosts=("node-a", "node-a", "node-a", "node-b", "node-c"))
    records.append({"host": "node-d"})  # a rank whose gpucomm puts no versions in its record
    with pytest.raises(GpucommError) as info:
        check_same_stack(records, rank=3)
    message = str(info.value)
    assert ("gpucomm: 0.1.0 on ranks 0-3 (node-a, node-b), 0.0.9 on rank 4 (node-c), unknown (an older gpucomm) on "
            "rank 5 (node-d)") in message, message
    assert "torch: 2.13 on ranks 0, 1, 2, 4 (node-a, node-c)" in message, message
    assert "2.1 on rank 3 (node-b)" in message, message
    assert "install the same gpucomm and torch on every host" in message, message


def test_another_python_is_only_a_warning_on_rank_0(caplog):
    records = _records(MINE, {**MINE, "python": "3.12.1"}, hosts=("node-a", "node-b"))
    with caplog.at_level(logging.WARNING, logger="gpucomm"):
        check_same_stack(records, rank=1)
        assert caplog.records == []
        check_same_stack(records, rank=0)
    assert "3.11 on rank 0 (node-a), 3.12 on rank 1 (node-b)" in caplog.text, caplog.text


def test_this_process_reports_its_own_versions():
    import gpucomm

    assert software_stack() == {"gpucomm": gpucomm.__version__, "torch": str(torch.__version__),
                                "python": platform.python_version()}


_REPORT_ERROR = """
    import os, sys
    import gpucomm.torch as hvd
    {before}
    try:
        hvd.init()
    except Exception as e:
        print(f"RANK {{os.environ['GPUCOMM_RANK']}} ERROR {{type(e).__name__}}: {{e}}", flush=True)
        sys.exit(3)
    print(f"RANK {{hvd.rank()}} RAN torch {{__import__('torch').__version__}}", flush=True)
    hvd.shutdown()
"""


@pytest.mark.parametrize("size, store_on_rank0", [(2, False), (4, True)])
def test_a_rank_of_another_gpucomm_fails_init_on_every_rank(tmp_path, size, store_on_rank0):
    """Rank 1 reports another gpucomm version (what a host with an older install would): every rank raises at
    init(), with the same message, instead of failing later on what they read from each other. Where rank 0 serves
    the store itself (torchrun, mpirun, Slurm), it keeps serving until the others have read the records (else
    they failed on its closed connection instead: rank 3 here reads the records slowly, as over a slow link)."""
    script = write_script(tmp_path, "other_gpucomm.py", textwrap.dedent(_REPORT_ERROR.format(before=textwrap.dedent("""
        import time
        import gpucomm.job.setup as setup
        if os.environ["GPUCOMM_RANK"] == "1":
            mine = setup.software_stack()
            setup.software_stack = lambda: {**mine, "gpucomm": "0.0.9"}
        if os.environ["GPUCOMM_RANK"] == "3":
            arrive = setup.arrive

            def slow_arrive(client, *args, **kwargs):
                get = client.get

                def slow_get(key, *a, **k):
                    if "/arrive/" in key:
                        time.sleep(0.3)
                    return get(key, *a, **k)
                client.get = slow_get
                return arrive(client, *args, **kwargs)
            setup.arrive = slow_arrive
    """).replace("\n", "\n    "))))
    results = run_rank_scripts([str(script)], size, timeout=120, store_on_rank0=store_on_rank0)
    assert len(results) == size
    for r, res in enumerate(results):
        assert res.returncode == 3, (r, res.stdout, res.stderr)
        assert f"RANK {r} ERROR GpucommError: the ranks of this job run different software versions" in res.stdout, \
            res.stdout
        assert "0.0.9 on rank 1" in res.stdout, res.stdout
    assert results[0].leftovers == []


def _torch_series(python: str) -> str | None:
    """``python``'s torch release series ("2.1"), or None when it has no torch (or does not run)."""
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                             timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return ".".join(out.stdout.strip().split("+")[0].split(".")[:2])


def _another_install() -> tuple[str, str] | None:
    """A virtual environment of this checkout with another torch series than this one's (CI's .ci/run makes
    .venv first, then .venv-torch-oldest and .venv-torch-newest), as (its python, its torch series)."""
    mine = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    for venv in (".venv", ".venv-torch-oldest", ".venv-torch-newest"):
        python = ROOT / venv / "bin" / "python"
        if not python.exists() or Path(PYTHON).resolve() == python.resolve():
            continue
        series = _torch_series(str(python))
        if series is not None and series != mine:
            return str(python), series
    return None


def test_ranks_of_two_real_installs_with_different_torch_fail_init_and_say_so(tmp_path):
    """Rank 0 in this virtual environment, rank 1 in another with another torch series: a host whose install
    differs. Both raise at init() naming both versions (before, the job went on and failed in Gloo, or hung)."""
    other = _another_install()
    if other is None:
        pytest.skip("no second virtual environment of this checkout with another torch series (.venv, "
                    ".venv-torch-oldest, .venv-torch-newest): .ci/run makes them for its torch-range steps")
    python, series = other
    mine = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    script = write_script(tmp_path, "two_installs.py", textwrap.dedent(_REPORT_ERROR.format(before="")))
    results = run_rank_scripts([str(script)], 2, timeout=180, pythons=[PYTHON, python])
    for r, res in enumerate(results):
        assert res.returncode == 3, (r, res.stdout, res.stderr)
        assert f"RANK {r} ERROR GpucommError: the ranks of this job run different software versions" in res.stdout, \
            res.stdout
        assert f"torch: {mine} on rank 0" in res.stdout and f"{series} on rank 1" in res.stdout, res.stdout
    assert results[0].leftovers == []


def test_in_an_elastic_round_newcomers_of_another_install_leave_and_the_veterans_re_form():
    """Workers of earlier rounds agree: the newcomer that differs is told it leaves, the others that the round
    re-forms without it. Where the veterans themselves differ, every rank raises alike."""
    veteran = {"host": "node-a", "stack": MINE, "veteran": True}
    records = [veteran, dict(veteran, host="node-b"), {"host": "node-c", "stack": {**MINE, "torch": "2.1.0"}},
               {"host": "node-d", "stack": MINE}]
    with pytest.raises(GpucommError, match=r"this worker \(rank 2, host node-c\) joined an elastic job whose workers "
                                           r"run another install"):
        check_same_stack(records, rank=2)
    for rank in (0, 1, 3):  # RoundReplaced: init() joins the next round
        with pytest.raises(RoundReplaced, match=r"rank 2 \(host node-c\) joined this elastic job with another install "
                                               r"\(torch: 2.13 on ranks 0, 1, 3 .*; they leave"):
            check_same_stack(records, rank=rank)
    split = [veteran, {"host": "node-b", "stack": {**MINE, "torch": "2.1.0"}, "veteran": True}]
    with pytest.raises(GpucommError, match="the ranks of this job run different software versions"):
        check_same_stack(split, rank=0)
