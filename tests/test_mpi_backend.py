"""The MPI data plane (``gpucomm/backends/mpi.py``), the CPU transport choice and ``gpucomm-run
--mpi``, under real MPI launchers: MPICH's mpiexec (``pip install "gpucomm[mpi]"``) and Open MPI's
mpirun (``apt-get install openmpi-bin``), each where installed. The rank side is
``tests/ranks/mpi_backend_program.py``. Every test skips with the reason when mpi4py or a launcher is
missing."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import textwrap
import time
from importlib.metadata import PackageNotFoundError, distribution
from importlib.util import find_spec
from pathlib import Path

import pytest

from gpucomm.backends.cpu_operations import choose_cpu_operations, explain_cpu_operations
from gpucomm.backends.mpi import MpiUnavailable
from gpucomm.runner.cli import main as cli_main
from gpucomm.runner.mpi_launch import (MpiLauncher, OutputServer, host_list, identify, launcher_argv,
                                       rank_environment)
from gpucomm.runner.mpi_rank import open_connection
from gpucomm.runner.output import OutputSink
from tests.harness import MARK, PYTHON, ROOT, launcher_cmd, run, started, write_script

PROGRAM = str(ROOT / "tests" / "ranks" / "mpi_backend_program.py")
NEEDS_MPI4PY = pytest.mark.skipif(find_spec("mpi4py") is None,
                                  reason='mpi4py is not installed (pip install "gpucomm[mpi]")')


def _mpich() -> MpiLauncher | None:
    for path in (str(Path(PYTHON).parent / "mpiexec"), shutil.which("mpiexec"), shutil.which("mpiexec.hydra")):
        if path and os.access(path, os.X_OK):
            found = identify(path)
            if found is not None and found.flavor == "mpich":
                return found
    return None


def _openmpi() -> MpiLauncher | None:
    for path in (shutil.which("mpirun.openmpi"), "/usr/bin/mpirun", shutil.which("mpirun"), shutil.which("orterun")):
        if path and os.access(path, os.X_OK):
            found = identify(path)
            if found is not None and found.flavor == "openmpi":
                return found
    return None


LAUNCHERS = {"mpich": _mpich(), "openmpi": _openmpi()}
INSTALL = {"mpich": 'MPICH\'s mpiexec is not installed (pip install "gpucomm[mpi]")',
           "openmpi": "Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)"}


def launcher(flavor: str) -> MpiLauncher:
    found = LAUNCHERS[flavor]
    if found is None:
        pytest.skip(INSTALL[flavor])
    if find_spec("mpi4py") is None:
        pytest.skip('mpi4py is not installed (pip install "gpucomm[mpi]")')
    return found


def mpi_cmd(flavor: str, n: int, *argv: str, abi: bool = True, exports: tuple[str, ...] = ()
            ) -> tuple[list[str], dict[str, str]]:
    """``argv`` on ``n`` ranks under ``flavor``'s launcher, and the environment for harness.run
    (Open MPI forwards ``exports`` too; MPICH forwards everything)."""
    found = launcher(flavor)
    if flavor == "mpich":
        return [found.path, "-n", str(n), *argv], {}
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    names = ["PYTHONPATH", "OMP_NUM_THREADS", MARK, *exports]
    if abi:  # mpi4py must load Open MPI's library, not the MPICH one gpucomm[mpi] brings
        env["MPI4PY_MPIABI"] = "openmpi"
        names.append("MPI4PY_MPIABI")
    return [found.path, "--oversubscribe", "-np", str(n), *[a for name in names for a in ("-x", name)], *argv], env


def ok_lines(stdout: str, prefix: str) -> list[str]:
    """The ranks' reports starting with ``prefix`` (the launcher may join lines of different ranks)."""
    return re.findall(re.escape(prefix) + r"[^\n]*", stdout)


# ---------------------------------------------------------------------------------------------
# the data plane


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_and_dtype_against_a_reference(flavor, size):
    """In place and out of place, every op and dtype, uneven allgather/alltoall, a process subset,
    a duplicate that progresses independently, two threads on two communicators."""
    cmd, env = mpi_cmd(flavor, size, PYTHON, PROGRAM, "all")
    r = run(cmd, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(size):
        for what in (f"OK collectives rank {rank} of {size}:", f"OK floats rank {rank}", f"OK groups rank {rank}",
                     f"OK independent rank {rank}", f"OK threads rank {rank}"):
            assert what in r.stdout, (what, r.stdout, r.stderr)
    checks = {int(n) for n in re.findall(r"OK collectives rank \d+ of \d+: (\d+) checks", r.stdout)}
    assert len(checks) == 1 and checks.pop() > 250, r.stdout
    assert r.leftovers == []


def test_a_stuck_collective_times_out_naming_it_and_the_job_is_aborted_at_exit():
    cmd, env = mpi_cmd("mpich", 2, PYTHON, PROGRAM, "timeout")
    r = run(cmd, timeout=120, env=env)
    assert "OK timeout rank 0" in r.stdout, r.stdout + r.stderr
    assert r.returncode != 0, r.stdout + r.stderr  # MPI_Abort, not a hang in MPI_Finalize
    assert "Calling MPI_Abort" in r.stderr and "allreduce of 1000 float32 (sum) on communicator 'world'" in r.stderr
    assert r.leftovers == []


def test_a_failure_elsewhere_releases_a_wait_at_once():
    cmd, env = mpi_cmd("mpich", 2, PYTHON, PROGRAM, "failed")
    r = run(cmd, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK failed-elsewhere rank 0" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_a_thread_level_below_multiple_is_refused_with_the_fix(flavor):
    cmd, env = mpi_cmd(flavor, 2, PYTHON, PROGRAM, "thread_level")
    r = run(cmd, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    if "SKIP thread level" in r.stdout:
        pytest.skip(r.stdout.strip())
    assert len(ok_lines(r.stdout, "OK thread level: ")) == 2, r.stdout + r.stderr


def test_open_mpi_launcher_with_mpich_library_is_refused_before_mpi_init():
    """MPICH's library aborts in MPI_Init under Open MPI's mpirun: load_mpi must see the mismatch
    first, and the automatic choice falls back to Gloo saying how to fix it."""
    try:
        distribution("mpich")
    except PackageNotFoundError:
        pytest.skip("the mpich wheel is not installed: mpi4py has no MPICH library to mismatch")
    cmd, env = mpi_cmd("openmpi", 2, PYTHON, PROGRAM, "mismatch", abi=False)
    r = run(["env", "-u", "MPI4PY_MPIABI", "-u", "MPI4PY_LIBMPI", *cmd], timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(ok_lines(r.stdout, "OK mismatch: ")) == 2, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# choosing the CPU transport


def test_choice_without_an_mpi_launcher_is_gloo_and_explicit_mpi_says_how_to_launch():
    assert choose_cpu_operations({}) == "gloo"
    assert "no MPI launcher" in explain_cpu_operations({"GPUCOMM_RANK": "0"}).reason
    assert choose_cpu_operations({"GPUCOMM_CPU_OPERATIONS": "gloo", "PMI_SIZE": "2"}) == "gloo"
    assert choose_cpu_operations({"HOROVOD_CPU_OPERATIONS": "GLOO", "PMI_SIZE": "2"}) == "gloo"
    with pytest.raises(MpiUnavailable, match="gpucomm-run --mpi"):
        choose_cpu_operations({"GPUCOMM_CPU_OPERATIONS": "mpi"})
    with pytest.raises(MpiUnavailable, match="elastic"):
        choose_cpu_operations({"HOROVOD_CPU_OPERATIONS": "mpi", "PMI_SIZE": "2", "GPUCOMM_ELASTIC": "1"})
    assert choose_cpu_operations({"PMI_SIZE": "2", "GPUCOMM_ELASTIC": "1"}) == "gloo"
    with pytest.raises(ValueError, match="GPUCOMM_CPU_OPERATIONS='ccl' is not a choice .*one of auto, gloo, mpi"):
        choose_cpu_operations({"GPUCOMM_CPU_OPERATIONS": "ccl"})


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_choice_under_an_mpi_launcher(flavor):
    cmd, env = mpi_cmd(flavor, 2, PYTHON, PROGRAM, "choose", exports=("GPUCOMM_CPU_OPERATIONS",))
    r = run(cmd, timeout=120, env=dict(env, GPUCOMM_CPU_OPERATIONS="auto"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(ok_lines(r.stdout, "CHOICE mpi: started by")) == 2, r.stdout + r.stderr
    r = run(cmd, timeout=120, env=dict(env, GPUCOMM_CPU_OPERATIONS="gloo"))
    assert len(ok_lines(r.stdout, "CHOICE gloo: GPUCOMM_CPU_OPERATIONS=gloo")) == 2, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# gpucomm-run --mpi


SHOW = """
    import os, re, sys
    rank = os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]
    size = os.environ.get("PMI_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"]
    secret = os.environ["GPUCOMM_SECRET"]
    print("rank", rank, "of", size, "secret", bool(re.fullmatch("[0-9a-f]{64}", secret)),
          "placed", "GPUCOMM_RANK" in os.environ, "store", os.environ["GPUCOMM_RENDEZVOUS_PORT"])
    print("err from", rank, file=sys.stderr)
"""


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_gpucomm_run_mpi_prefixes_each_ranks_lines(tmp_path, flavor):
    found = launcher(flavor)
    script = write_script(tmp_path, "show.py", textwrap.dedent(SHOW))
    r = run(launcher_cmd("--mpi", "--verbose", "-np", "3", PYTHON, str(script)), timeout=120,
            env={"GPUCOMM_MPIEXEC": found.path, "GPUCOMM_RANK": "7"})  # a stale rank variable is dropped
    assert r.returncode == 0, r.stdout + r.stderr
    ports = set()
    for rank in range(3):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"[{rank}]<stdout>:rank {rank} of 3"))
        assert "secret True placed False" in line, line
        ports.add(line.rsplit(" ", 1)[1])
        assert f"[{rank}]<stderr>:err from {rank}" in r.stderr.splitlines(), r.stderr
    assert len(ports) == 1  # one store, served by gpucomm-run
    command = next(x for x in r.stderr.splitlines() if "launcher command:" in x)
    assert command.split("launcher command: ")[1].startswith(found.path) and "GPUCOMM_SECRET=" not in command
    assert r.leftovers == []


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_gpucomm_run_mpi_runs_a_gpucomm_job(flavor):
    found = launcher(flavor)
    r = run(launcher_cmd("--mpi", "-np", "2", PYTHON, "examples/hello_allreduce.py"), timeout=120,
            env={"GPUCOMM_MPIEXEC": found.path})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0]<stdout>:allreduce over 2 ranks OK" in r.stdout, r.stdout + r.stderr
    assert "[1]<stdout>:rank 1/2 local 1/2 cross 0/1" in r.stdout, r.stdout
    assert r.leftovers == []


def test_gpucomm_run_mpi_reports_the_failed_rank_and_stops_the_job(tmp_path):
    """MPICH's launcher waits for every rank even after one failed; gpucomm-run reads the failure
    report from its store and stops the job."""
    found = launcher("mpich")
    script = write_script(tmp_path, "fail.py", textwrap.dedent("""
        import time
        import gpucomm.torch as hvd
        hvd.init()
        print("up", hvd.rank(), flush=True)
        if hvd.rank() == 1:
            raise RuntimeError("rank one broke")
        time.sleep(100)
    """))
    r = run(launcher_cmd("--mpi", "-np", "2", PYTHON, str(script)), timeout=90, env={"GPUCOMM_MPIEXEC": found.path})
    assert r.returncode != 0, r.stdout + r.stderr
    assert "gpucomm-run: rank 1 on" in r.stderr and "failed first: RuntimeError: rank one broke" in r.stderr, r.stderr
    assert r.leftovers == []


def test_gpucomm_run_mpi_refuses_what_it_cannot_do(capsys):
    for argv, text in ((["--mpi", "--min-np", "1", "-np", "2", "x"], "elastic"),
                       (["--mpi-args=-v", "-np", "2", "x"], "--mpi-args needs --mpi"),
                       (["--mpi", "-p", "2222", "-np", "2", "x"], "--mpi-args")):
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert info.value.code == 2
        assert text in capsys.readouterr().err


def test_launcher_command_lines_keep_the_secret_off_them():
    hosts = host_list(["n1", "n1", "n2"])
    assert hosts == "n1:2,n2:1"
    env = rank_environment({"PATH": "/bin", "GPUCOMM_RANK": "3", "HOROVOD_SIZE": "9", "OTHER": "x"},
                           {"GPUCOMM_TIMEOUT": "30"}, MpiLauncher("/x/mpirun", "openmpi", "4.1"),
                           rendezvous_addr="10.0.0.1", rendezvous_port=1234, secret=b"k" * 32, run_id="r1")
    assert "GPUCOMM_RANK" not in env and "HOROVOD_SIZE" not in env and env["MPI4PY_MPIABI"] == "openmpi"
    assert env["GPUCOMM_SECRET"] == (b"k" * 32).hex() and env["GPUCOMM_RENDEZVOUS_HOSTED"] == "1"
    ompi = launcher_argv(MpiLauncher("/x/mpirun", "openmpi", "4.1"), ["n1", "n1", "n2"], ["python", "t.py"], env,
                         nic="eth1")
    assert ompi[:5] == ["/x/mpirun", "-np", "3", "-H", "n1:2,n2:1"] and ompi[-2:] == ["python", "t.py"]
    exported = {ompi[i + 1] for i, a in enumerate(ompi) if a == "-x"}
    assert {"GPUCOMM_SECRET", "GPUCOMM_RENDEZVOUS_ADDR", "GPUCOMM_TIMEOUT", "PATH", "MPI4PY_MPIABI"} <= exported
    assert "OTHER" not in exported and "btl_tcp_if_include" in ompi
    mpich = launcher_argv(MpiLauncher("/v/mpiexec", "mpich", "Hydra 5"), ["n1", "n2"], ["python", "t.py"], env)
    assert mpich == ["/v/mpiexec", "-n", "2", "-hosts", "n1:1,n2:1", "python", "t.py"]
    assert not any(env["GPUCOMM_SECRET"] in a for a in ompi + mpich)


def test_output_connections_need_the_jobs_mac():
    out, err = io.StringIO(), io.StringIO()
    sink = OutputSink(2, stdout=out, stderr=err)
    server = OutputServer(sink, "127.0.0.1", b"s" * 32, "run", 2)
    try:
        conn, _ = open_connection("127.0.0.1", server.port, b"s" * 32, "run", 1, "stdout")
        with conn:
            conn.sendall(b"genuine\n")
        with pytest.raises(OSError):  # refused: the connection closes instead of saying OK
            open_connection("127.0.0.1", server.port, b"x" * 32, "run", 0, "stdout")
        deadline = time.monotonic() + 10
        while "genuine" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        for t in server.pumps:
            t.join(5)
    finally:
        server.close()
    assert out.getvalue() == "[1]<stdout>:genuine\n"


def test_mpirun_recipe_under_open_mpi():
    found = launcher("openmpi")
    r = run(["bash", str(ROOT / "launch" / "mpirun.sh"), "2", "localhost:2", PYTHON, "examples/hello_allreduce.py"],
            timeout=120, env={"MPIRUN": found.path, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allreduce over 2 ranks OK" in r.stdout
    assert "WARNING" not in r.stderr, r.stderr  # the recipe passes a secret
    assert r.leftovers == []


# ---------------------------------------------------------------------------------------------
# the benchmark, at its smallest


def test_benchmark_runs_and_writes_json(tmp_path):
    cmd, env = mpi_cmd("mpich", 2, PYTHON, "-W", "ignore::FutureWarning", str(ROOT / "benchmarks" / "mpi_vs_gloo.py"),
                       "--quick", "--json", str(tmp_path / "b.json"))
    r = run(cmd, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    kinds = {(x["kind"], x["bytes"], x["dtype"]) for x in doc["results"]}
    assert {(k, s, "float32") for k in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
            for s in (64 << 10, 1 << 20)} | {("allreduce", 1 << 20, "bfloat16")} == kinds
    for x in doc["results"]:
        for impl, stats in x["seconds"].items():
            assert stats["median"] is not None and stats["median"] > 0, (impl, x)
    assert "MPI/Gloo bw" in r.stdout and doc["ranks"] == 2


def test_no_launcher_found_says_how_to_get_one(tmp_path):
    from gpucomm.runner.mpi_launch import MpiLaunchError, find_launcher

    with pytest.raises(MpiLaunchError, match="is not an MPI launcher gpucomm knows"):
        find_launcher({"GPUCOMM_MPIEXEC": shutil.which("true") or "/bin/true"})
    with pytest.raises(MpiLaunchError, match=r'pip install "gpucomm\[mpi\]"'):
        find_launcher({"PATH": str(tmp_path)}, python=str(tmp_path / "python"))


_HOLD = """
    import sys, time
    from pathlib import Path
    import torch
    import gpucomm.torch as hvd
    job, flag = sys.argv[1], Path(sys.argv[2])
    hvd.init()
    print(f"JOB {job} RANK {hvd.rank()} READY", flush=True)
    if job == "A":  # holds its store until job B has finished (at most 60 s)
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    rank = hvd.rank()
    print(f"JOB {job} RANK {rank} SUM {total:g}", flush=True)
    hvd.shutdown()
    if job == "B" and rank == 0:
        flag.write_text("done")
"""


# rank 0 runs under 6 wrapper shells, each of which forks the next (a profiler's or a site's wrappers): the
# proxy whose --control-port names the job is further up its process tree than rank 1's
_WRAP = """#!/bin/sh
if [ "$PMI_RANK" = 0 ] && [ "${WRAPPED:-0}" -lt 6 ]; then
    WRAPPED=$(( ${WRAPPED:-0} + 1 )) "$0" "$@"
    exit $?
fi
exec "$@"
"""


@pytest.mark.parametrize("inside", [{}, {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}],
                         ids=["alone", "one-slurm-allocation"])
def test_two_mpiexec_jobs_whose_rank_0_share_a_host_keep_apart(tmp_path, inside):
    """MPICH's mpiexec exports no job id, and the store's port and derived secret come from it: before, a second
    job on the same host derived the first one's port and secret, joined its store, and the first job failed ('two
    processes claim rank 0 of this job'; found by helper-61). Each job now takes mpiexec's own address, which every
    proxy of its job is started with, as its id: both run, side by side, also as two runs of one Slurm allocation
    (the job id they share does not tell them apart) and with rank 0 under wrappers (6 forks deep: helper-62)."""
    found = launcher("mpich")
    script = write_script(tmp_path, "hold.py", textwrap.dedent(_HOLD))
    wrap = write_script(tmp_path, "wrap.sh", _WRAP)
    wrap.chmod(0o755)
    flag = tmp_path / "b_done"
    env = {"GPUCOMM_START_TIMEOUT": "30", "GPUCOMM_CPU_OPERATIONS": "gloo", **inside}
    with started([found.path, "-n", "2", str(wrap), PYTHON, str(script), "A", str(flag)], env=env, timeout=120,
                 stderr=subprocess.STDOUT) as a:
        for line in a.proc.stdout:  # job A holds its store before job B starts
            if "JOB A RANK 0 READY" in line:
                break
        b = run([found.path, "-n", "2", PYTHON, str(script), "B", str(flag)], env=env, timeout=120)
        rest = a.proc.stdout.read()
        assert a.proc.wait(timeout=60) == 0, rest
    assert b.returncode == 0, b.stdout + b.stderr
    assert sorted(re.findall(r"JOB B RANK \d SUM 2", b.stdout)) == ["JOB B RANK 0 SUM 2", "JOB B RANK 1 SUM 2"]
    assert sorted(re.findall(r"JOB A RANK \d SUM 2", rest)) == ["JOB A RANK 0 SUM 2", "JOB A RANK 1 SUM 2"], rest
    assert a.leftovers == [] and b.leftovers == []
