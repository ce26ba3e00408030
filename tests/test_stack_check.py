"""Ranks started from different installs (gpucomm, torch's release series) fail at init() on every rank, naming
which ranks and hosts run what; a different Python only gets rank 0's warning. One job here mixes two real
virtual environments (torch 2.1 and 2.13) where this checkout has both: CI's torch-range steps."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import gpucomm
from gpucomm.errors import GpucommError, RoundReplaced
from gpucomm.backends.nccl import version_text
from gpucomm.job import stack_check
from gpucomm.job.stack_check import check_same_stack, software_stack
from gpucomm.source_digest import DIGEST_CHARS, source_digest
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
    assert software_stack() == {"gpucomm": gpucomm.__version__, "gpucomm_sources": source_digest(),
                                "torch": str(torch.__version__), "python": platform.python_version()}
    assert len(source_digest()) == DIGEST_CHARS and int(source_digest(), 16) >= 0


def _copy_of_gpucomm(where: Path, edit: str | None = None) -> Path:
    """A copy of this checkout's gpucomm package under ``where`` (what another host's install holds), with
    ``edit`` appended to its errors.py when given; returns the folder to put on sys.path."""
    shutil.copytree(ROOT / "gpucomm", where / "gpucomm", ignore=shutil.ignore_patterns("__pycache__"))
    if edit is not None:
        with open(where / "gpucomm" / "errors.py", "a") as f:
            f.write(edit)
    return where


def test_the_sources_digest_follows_the_sources_not_where_they_are(tmp_path):
    """The same files elsewhere (another host's install of the same commit) give the same digest; one line added to
    one file gives another."""
    same = _copy_of_gpucomm(tmp_path / "same")
    edited = _copy_of_gpucomm(tmp_path / "edited", edit="# a local change on one host\n")
    digests = {}
    for name, where in (("same", same), ("edited", edited)):
        out = subprocess.run([PYTHON, "-c", "import gpucomm, gpucomm.source_digest as s; print(gpucomm.__file__); "
                              "print(s.source_digest())"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(where)})
        assert out.returncode == 0, out.stderr
        path, digests[name] = out.stdout.split()
        assert Path(path).is_relative_to(where), (path, where)  # the copy ran, not this checkout
    assert digests["same"] == source_digest() and digests["edited"] != source_digest(), digests


def test_one_version_from_other_sources_names_the_ranks_and_their_digests():
    mine, theirs = {**MINE, "gpucomm_sources": "aaaaaaaaaaaa"}, {**MINE, "gpucomm_sources": "bbbbbbbbbbbb"}
    unknown = {**MINE, "gpucomm_sources": None}  # sources it could not read: compared by version only
    check_same_stack(_records(mine, unknown, mine), rank=0)
    with pytest.raises(GpucommError) as info:
        check_same_stack(_records(mine, mine, theirs, unknown, hosts=("node-a", "node-a", "node-b", "node-c")), rank=2)
    message = str(info.value)
    assert ("gpucomm 0.1.0 built from different sources, by their digests aaaaaaaaaaaa on ranks 0-1 (node-a), "
            "bbbbbbbbbbbb on rank 2 (node-b): a checkout or image of another commit, or a .py file edited, added or left "
            "over on one host (a stale build/ folder in a wheel)") in message, message
    assert "rank 3" not in message, message
    # another version: named as such, not again as other sources (a version each)
    with pytest.raises(GpucommError) as info:
        check_same_stack(_records(mine, {**theirs, "gpucomm": "0.0.9"}), rank=0)
    assert "gpucomm: 0.1.0 on rank 0" in str(info.value) and "sources" not in str(info.value).split("). ")[0]


_REPORT_ERROR = """
    import os, sys
    {first}
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
    """Rank 1 runs another gpucomm: at 2 ranks a real copy of this one's sources with one line added (a checkout
    edited or updated on one host: the same version), at 4 it reports another version (a host with an older
    install). Every rank raises at init(), with the same message, instead of failing later on what they read from
    each other. Where rank 0 serves the store itself (torchrun, mpirun, Slurm), it keeps serving until the others
    have read the records (else they failed on its closed connection instead: rank 3 here reads the records
    slowly, as over a slow link)."""
    edited = size == 2
    copy = _copy_of_gpucomm(tmp_path / "other", edit="# a local change on one host\n") if edited else None
    first = f"if os.environ['GPUCOMM_RANK'] == '1': sys.path.insert(0, {str(copy)!r})" if edited else ""
    script = write_script(tmp_path, "other_gpucomm.py", textwrap.dedent(_REPORT_ERROR.format(
        first=first, before=textwrap.dedent("""
        import time
        import gpucomm.job.setup as setup
        if os.environ["GPUCOMM_RANK"] == "1":
            assert ("/other/" in setup.__file__) == EDITED, setup.__file__  # rank 1 runs the copy, if any
            if not EDITED:
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
    """).replace("EDITED", str(edited)).replace("\n", "\n    "))))
    results = run_rank_scripts([str(script)], size, timeout=120, store_on_rank0=store_on_rank0)
    assert len(results) == size
    for r, res in enumerate(results):
        assert res.returncode == 3, (r, res.stdout, res.stderr)
        assert f"RANK {r} ERROR GpucommError: the ranks of this job run different software versions" in res.stdout, \
            res.stdout
        if edited:
            assert f"gpucomm {gpucomm.__version__} built from different sources, by their digests " \
                   f"{source_digest()} on rank 0" \
                in res.stdout and "a .py file edited, added or left over on one host" in res.stdout, res.stdout
        else:
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
    script = write_script(tmp_path, "two_installs.py", textwrap.dedent(_REPORT_ERROR.format(first="", before="")))
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
    # the same version from other sources: the newcomer leaves too; one that cannot read its sources stays
    mine = {**MINE, "gpucomm_sources": "aaaaaaaaaaaa"}
    records = [{"host": "node-a", "stack": {**MINE, "gpucomm_sources": None}, "veteran": True},
               {"host": "node-b", "stack": mine, "veteran": True},
               {"host": "node-c", "stack": {**MINE, "gpucomm_sources": "bbbbbbbbbbbb"}},
               {"host": "node-d", "stack": {**MINE, "gpucomm_sources": None}}]
    with pytest.raises(GpucommError, match=r"this worker \(rank 2, host node-c\) joined an elastic job"):
        check_same_stack(records, rank=2)
    for rank in (0, 1, 3):
        with pytest.raises(RoundReplaced, match=r"rank 2 \(host node-c\) joined this elastic job with another "
                                               r"install \(gpucomm 0.1.0 built from different sources"):
            check_same_stack(records, rank=rank)
    # no veteran reports its sources (a zipped install) and two newcomers' differ: both leave, not the veterans;
    # a newcomer that reports none stays
    records = [{"host": "node-a", "stack": {**MINE, "gpucomm_sources": None}, "veteran": True},
               {"host": "node-b", "stack": {**MINE, "gpucomm_sources": "aaaaaaaaaaaa"}},
               {"host": "node-c", "stack": {**MINE, "gpucomm_sources": "bbbbbbbbbbbb"}},
               {"host": "node-d", "stack": MINE}]
    for rank in (1, 2):
        with pytest.raises(GpucommError, match=rf"this worker \(rank {rank}, .* joined an elastic job"):
            check_same_stack(records, rank=rank)
    for rank in (0, 3):
        with pytest.raises(RoundReplaced, match=r"ranks 1-2 \(hosts node-b, node-c\) joined"):
            check_same_stack(records, rank=rank)
    # one newcomer of another version, one of the same version from other sources: each is told why
    records = [{"host": "node-a", "stack": mine, "veteran": True},
               {"host": "node-b", "stack": {**mine, "gpucomm": "0.0.9"}},
               {"host": "node-c", "stack": {**MINE, "gpucomm_sources": "bbbbbbbbbbbb"}}]
    with pytest.raises(GpucommError, match=r"rank 2, host node-c.* \(gpucomm: .*; gpucomm 0.1.0 built from different "
                                           r"sources, by their digests aaaaaaaaaaaa on rank 0 \(node-a\), "
                                           r"bbbbbbbbbbbb on rank 2 \(node-c\)"):
        check_same_stack(records, rank=2)
    split = [veteran, {"host": "node-b", "stack": {**MINE, "torch": "2.1.0"}, "veteran": True}]
    with pytest.raises(GpucommError, match="the ranks of this job run different software versions"):
        check_same_stack(split, rank=0)


GPU = {**MINE, "nccl": "2.32.3"}


def test_ranks_with_a_gpu_must_load_one_nccl_down_to_the_patch():
    """NCCL refuses ranks of other versions (ncclInvalidUsage at the first GPU collective, naming no host): every
    rank raises at init() instead, naming who loads which. Ranks without a GPU report none and are not compared."""
    check_same_stack(_records(GPU, GPU, MINE), rank=0)  # a rank without a GPU (none reported) is no difference
    records = _records(GPU, GPU, {**GPU, "nccl": "2.32.2"}, MINE, hosts=("node-a", "node-a", "node-b", "node-c"))
    with pytest.raises(GpucommError) as info:
        check_same_stack(records, rank=3)
    message = str(info.value)
    assert ("NCCL (CuPy's, on the ranks with a GPU): 2.32.3 on ranks 0-1 (node-a), 2.32.2 on rank 2 (node-b): NCCL "
            "connects only ranks of one version, down to the patch") in message, message
    assert "the same nvidia-nccl-cu12/-cu13 wheel on every host" in message, message
    unloadable = _records(GPU, {**GPU, "nccl": stack_check.NCCL_UNAVAILABLE}, hosts=("node-a", "node-b"))
    with pytest.raises(GpucommError, match=r"2.32.3 on rank 0 \(node-a\), none \(CuPy's NCCL cannot be loaded\) on "
                                           r"rank 1 \(node-b\)"):
        check_same_stack(unloadable, rank=0)
    # a difference of gpucomm's own only: no word on NCCL
    with pytest.raises(GpucommError) as info:
        check_same_stack(_records(GPU, {**GPU, "torch": "2.1.0"}), rank=0)
    assert "NCCL" not in str(info.value)


def test_in_an_elastic_round_a_newcomer_with_another_nccl_leaves():
    veteran = {"host": "node-a", "stack": GPU, "veteran": True}
    records = [veteran, {"host": "node-b", "stack": MINE, "veteran": True},  # a veteran without a GPU
               {"host": "node-c", "stack": {**GPU, "nccl": "2.28.9"}}, {"host": "node-d", "stack": GPU},
               {"host": "node-e", "stack": MINE}]  # a newcomer without a GPU: nothing to compare
    with pytest.raises(GpucommError, match=r"this worker \(rank 2, host node-c\) joined an elastic job whose workers "
                                           r"run another install \(NCCL \(CuPy's, on the ranks with a GPU\): 2.32.3 on "
                                           r"ranks 0, 3 \(node-a, node-d\), 2.28.9 on rank 2 \(node-c\)"):
        check_same_stack(records, rank=2)
    for rank in (0, 1, 3, 4):
        with pytest.raises(RoundReplaced, match=r"rank 2 \(host node-c\) joined this elastic job with another"):
            check_same_stack(records, rank=rank)
    # no veteran has a GPU and two newcomers' NCCL differ: which is the job's is unknown, so both leave
    records = [{"host": "node-a", "stack": MINE, "veteran": True}, {"host": "node-b", "stack": GPU},
               {"host": "node-c", "stack": {**GPU, "nccl": "2.28.9"}}]
    for rank in (1, 2):
        with pytest.raises(GpucommError, match=rf"this worker \(rank {rank}, .* joined an elastic job"):
            check_same_stack(records, rank=rank)
    with pytest.raises(RoundReplaced, match=r"ranks 1-2 \(hosts node-b, node-c\) joined"):
        check_same_stack(records, rank=0)
    # a newcomer that surely differs (its NCCL) is left out before the unknown sources are judged: the one that
    # matches the job stays (before, both left, as their sources differed and none of the veterans' was known)
    records = [{"host": "node-a", "stack": {**GPU, "gpucomm_sources": None}, "veteran": True},
               {"host": "node-b", "stack": {**GPU, "gpucomm_sources": "aaaaaaaaaaaa", "nccl": "2.28.9"}},
               {"host": "node-c", "stack": {**GPU, "gpucomm_sources": "bbbbbbbbbbbb"}}]
    with pytest.raises(GpucommError, match=r"this worker \(rank 1, host node-b\) joined an elastic job"):
        check_same_stack(records, rank=1)
    for rank in (0, 2):
        with pytest.raises(RoundReplaced, match=r"^rank 1 \(host node-b\) joined"):
            check_same_stack(records, rank=rank)


def _nccl_library_version(python: str, library: Path | None = None) -> int:
    """The NCCL version ``python``'s CuPy reports, with ``library`` preloaded in its place (0: none loads)."""
    env = dict(os.environ, **({"LD_PRELOAD": str(library)} if library else {}))
    r = subprocess.run([python, "-c", "from cupy.cuda import nccl; print(nccl.get_version())"], env=env,
                       capture_output=True, text=True, timeout=120)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def _another_nccl() -> tuple[str, Path, int, int] | None:
    """An interpreter of this checkout with CuPy, a libnccl of another version installed beside this checkout (the
    torch-range venvs' torch wheels bring their own), and both versions; None when there is none."""
    pythons = [PYTHON] + [str(p) for p in sorted(ROOT.glob(".venv*/bin/python")) if str(p) != PYTHON]
    libraries = sorted(ROOT.glob(".venv*/lib/python*/site-packages/nvidia/nccl/lib/libnccl.so.2"))
    for python in pythons:
        mine = _nccl_library_version(python)
        if not mine:
            continue
        for library in libraries:
            theirs = _nccl_library_version(python, library)
            if theirs and theirs != mine:
                return python, library, mine, theirs
        return None
    return None


# rank 1's host has another install's NCCL: the same process, with that library loaded in place of CuPy's
_OTHER_NCCL_ON_RANK_1 = "\n    ".join([
    'if os.environ["GPUCOMM_RANK"] == "1" and os.environ.get("LD_PRELOAD") != sys.argv[1]:',
    '    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, LD_PRELOAD=sys.argv[1]))'])
# pinned to a GPU, as on a GPU host (this machine has none): the arrival record then names its NCCL
_ON_A_PRETEND_GPU = "\n    ".join([
    "from gpucomm.bootstrap import devices",
    'rank = int(os.environ["GPUCOMM_RANK"])',
    'gpu = devices.GpuInfo(rank, f"0000:1{rank}:00.0", f"GPU-test-{rank}", "Test GPU", 1 << 30)',
    "devices.pin_local_gpu = lambda *a, **k: devices.PinnedDevice(gpu, rank)",
    "devices.select_device = lambda ordinal: None"])


def test_ranks_that_load_two_real_nccls_fail_init_and_say_so(tmp_path):
    """Rank 1 loads another real libnccl (LD_PRELOAD: a host whose NCCL wheel or system library differs); both ranks
    sit on GPUs stood in for. Both raise at init() naming both versions, before any communicator is made."""
    other = _another_nccl()
    if other is None:
        pytest.skip("no libnccl of another version beside this checkout (.ci/run's torch-range venvs bring one with "
                    "their torch wheels) or no CuPy here")
    python, library, mine, theirs = other
    script = write_script(tmp_path, "two_nccls.py", textwrap.dedent(_REPORT_ERROR.format(
        first=_OTHER_NCCL_ON_RANK_1, before=_ON_A_PRETEND_GPU)))
    results = run_rank_scripts([str(script), str(library)], 2, timeout=180, pythons=[python, python])
    expected = f"{version_text(mine)} on rank 0 (node-a), {version_text(theirs)} on rank 1 (node-a)"
    for r, res in enumerate(results):
        assert res.returncode == 3, (r, res.stdout, res.stderr)
        assert f"RANK {r} ERROR GpucommError: the ranks of this job run different software versions" in res.stdout, \
            res.stdout
        assert "NCCL (CuPy's, on the ranks with a GPU): " + expected.replace("node-a", platform.node()) in res.stdout, \
            res.stdout
    assert results[0].leftovers == []
