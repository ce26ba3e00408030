"""gpucomm.torch.init() unchanged under other launchers: real torchrun and, when installed, real
Open MPI mpirun (``.ci/run`` installs it), each running a 2-rank allreduce."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.harness import PYTHON, run

ROOT = Path(__file__).resolve().parent.parent


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    if shutil.which("torchrun"):
        return ["torchrun"]
    return [sys.executable, "-m", "torch.distributed.run"]


def test_allreduce_under_torchrun():
    r = run(_torchrun() + ["--standalone", "--nproc-per-node", "2", "examples/hello_allreduce.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0/2 local 0/2 cross 0/1" in r.stdout and "rank 1/2 local 1/2 cross 0/1" in r.stdout
    assert "allreduce over 2 ranks OK" in r.stdout
    assert r.leftovers == []


def test_readme_training_example_under_gpucomm_run():
    r = run([PYTHON, "-m", "gpucomm.runner", "-np", "2", PYTHON, "examples/train_digits.py", "--epochs", "6"],
            timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", r.stdout).group(1))
    assert accuracy >= 0.9, r.stdout
    assert "2 ranks" in r.stdout
    assert r.leftovers == []


def test_allreduce_under_open_mpi():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)")
    version = run([mpirun, "--version"], timeout=60)
    if "Open MPI" not in version.stdout + version.stderr:
        pytest.skip(f"mpirun on PATH is not Open MPI: {(version.stdout + version.stderr).strip()[:200]}")
    r = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
             "-x", "GPUCOMM_TEST_JOB_MARK", PYTHON, "examples/hello_allreduce.py"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0/2 local 0/2 cross 0/1" in r.stdout and "rank 1/2 local 1/2 cross 0/1" in r.stdout
    assert "allreduce over 2 ranks OK" in r.stdout
    assert r.leftovers == []
    # no GPUCOMM_SECRET was passed: the store's key is derived, and rank 0 (only) says so, once
    warnings = [line for line in r.stderr.splitlines() if "accepts any process that can reach 127.0.0.1:" in line]
    assert len(warnings) == 1 and "gpucomm rank 0 WARNING" in warnings[0], r.stderr


def _with_venv_path() -> dict[str, str]:
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


@pytest.mark.parametrize("recipe, args", [
    ("gpucomm-run.sh", ["2", "localhost:2", PYTHON, "examples/hello_allreduce.py"]),
    ("torchrun.sh", ["2", "examples/hello_allreduce.py"]),
    ("mpirun.sh", ["2", "localhost:2", PYTHON, "examples/hello_allreduce.py"]),
])
def test_launch_recipes_run_a_job(recipe, args):
    if recipe == "mpirun.sh" and shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)")
    r = run(["bash", str(ROOT / "launch" / recipe), *args], env=_with_venv_path(), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allreduce over 2 ranks OK" in r.stdout
    # no warning of gpucomm's (the MPI recipe passes a secret); torch 2.1's torchrun warns about its own
    # --standalone defaults ("master_addr is only used for static rdzv_backend"), which is not gpucomm's to fix
    ours = [line for line in r.stderr.splitlines() if "torch.distributed.run: [WARNING]" not in line]
    assert not any("Warning" in line or "WARNING" in line for line in ours), r.stderr
    assert r.leftovers == []


@pytest.mark.parametrize("recipe", ["slurm.sbatch", "docker-run.sh"])
def test_other_recipes_are_valid_bash(recipe):
    r = run(["bash", "-n", str(ROOT / "launch" / recipe)], timeout=60)
    assert r.returncode == 0, r.stderr


def test_allreduce_with_an_srun_environment():
    """Two processes given the variables srun sets for a 2-task step on one node (Slurm itself is
    not installed here): init() finds its place and the store from them alone."""
    import secrets

    job = str(secrets.randbelow(10**6) + 10**6)  # the store's port is derived from the job id
    common = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0",
              "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "GPUCOMM_SECRET": secrets.token_hex(32)}
    script = ("import os, runpy, subprocess, sys; env = dict(os.environ, **{k: v for k, v in %r.items()}); "
              "procs = [subprocess.Popen([sys.executable, 'examples/hello_allreduce.py'], "
              "env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(2)]; "
              "sys.exit(max(p.wait(timeout=100) for p in procs))") % common
    r = run([PYTHON, "-c", script], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1/2 local 1/2 cross 0/1" in r.stdout and "allreduce over 2 ranks OK" in r.stdout
    assert r.leftovers == []
