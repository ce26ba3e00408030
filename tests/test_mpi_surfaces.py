"""The launch surfaces of ``gpucomm-run --mpi`` (issue 36, findings 1 and 3), under real MPI
launchers (rank side: ``tests/ranks/mpi_surface_program.py``; the rank channel's own attacks are in
``tests/test_rank_channel.py``):

- a rank killed by a signal is named on every other rank and in gpucomm-run's summary, whichever
  rank it is, and gpucomm-run exits 128 + the signal, as under its own launcher;
- a one-host job's sockets listen on loopback only, except the MPI launcher's own listeners, which
  neither MPICH's Hydra nor Open MPI's mpirun can be told to bind (docs/guide/security.md, "MPI's own sockets");
- the options and variables that bind MPI's sockets, and the blame rules, as pure functions.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
from dataclasses import dataclass

import psutil
import pytest

from gpucomm.failures import Failure
from gpucomm.runner.mpi_launch import (MpiLauncher, binding_environment, binding_interface, blame, launcher_argv,
                                       loopback_interface)
from gpucomm.runner.rank_channel import RankEnd
from tests.harness import PYTHON, ROOT, launcher_cmd, marked_processes, run, started
from tests.test_mpi_backend import launcher

PROGRAM = str(ROOT / "tests" / "ranks" / "mpi_surface_program.py")
# the MPI launchers' own processes (their control listeners cannot be bound to an interface): Hydra's
# mpiexec and proxies, Open MPI's mpirun (orterun, mpirun.openmpi) and daemons, PRRTE's
LAUNCHER_PROCESSES = ("mpiexec", "hydra_pmi_proxy", "mpirun", "orterun", "orted", "prterun", "prted")


# ---------------------------------------------------------------------------------------------
# finding 1: a killed rank is named, and the exit status is 128 + signal


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_killed_rank_is_named_on_every_rank_and_in_the_summary(victim):
    found = launcher("mpich")
    r = run(launcher_cmd("--mpi", "-np", "3", PYTHON, PROGRAM, "kill", str(victim)), timeout=180,
            env={"GPUCOMM_MPIEXEC": found.path})
    ended = time.time()
    assert r.returncode == 137, r.stdout + r.stderr  # 128 + SIGKILL, as gpucomm-run's own launcher gives
    summary = [x for x in r.stderr.splitlines() if x.startswith("gpucomm-run: job failed:")]
    assert len(summary) == 1, r.stderr
    assert summary[0].startswith(f"gpucomm-run: job failed: rank {victim} on ") and "killed by SIGKILL" in summary[0]
    assert summary[0].endswith("gpucomm-run exits with 137."), summary
    named = "rank 0 (the coordinator)" if victim == 0 else f"rank {victim} exited or crashed"
    for survivor in sorted(set(range(3)) - {victim}):
        said = [x for x in r.stderr.splitlines() if x.startswith(f"[{survivor}]<stderr>:") and named in x]
        assert said, f"rank {survivor} never named rank {victim}:\n{r.stderr}"
    killed = float(re.search(r"KILLED_AT ([0-9.]+)", r.stderr).group(1))
    print(f"rank {victim} of 3 SIGKILLed: gpucomm-run exited {ended - killed:.2f} s later with {r.returncode}")
    assert r.leftovers == []


# ---------------------------------------------------------------------------------------------
# finding 3: MPI's sockets listen where gpucomm announces


@dataclass(frozen=True)
class Listener:
    process: str
    pid: int
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address.split("%")[0]).is_loopback


def _listeners(mark: str) -> list[Listener]:
    """Every listening TCP socket of the job's processes (all carry the harness's mark)."""
    found = []
    for p in marked_processes(mark):
        try:
            name, conns = p.name(), p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        found += [Listener(name, p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def _read_lines(proc: subprocess.Popen, text: str, count: int) -> list[str]:
    """``proc``'s stdout lines up to its ``count``-th holding ``text``; a job that ends first fails the
    test with all it printed, stderr and exit status included."""
    lines: list[str] = []
    while sum(text in x for x in lines) < count:
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate(timeout=60)
            raise AssertionError(f"the job ended (status {proc.returncode}) before {count} {text!r} lines:\n"
                                 f"{''.join(lines)}\n--- stderr ---\n{err}")
        lines.append(line)
    return lines


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_a_one_host_job_listens_on_loopback_only(tmp_path, flavor):
    found = launcher(flavor)
    cmd = launcher_cmd("--mpi", "-np", "3", PYTHON, PROGRAM, "listen", str(tmp_path))
    with started(cmd, env={"GPUCOMM_MPIEXEC": found.path}, timeout=180) as job:
        ready = _read_lines(job.proc, "READY", 3)
        listeners = _listeners(job.mark)
        (tmp_path / "go").touch()
        out, err = job.proc.communicate(timeout=120)
    assert job.proc.returncode == 0, "".join(ready) + out + err
    assert sum("mpi=True" in x for x in ready) == 3, ready  # MPI's data plane was up while we looked
    ours = [x for x in listeners if not x.process.startswith(LAUNCHER_PROCESSES)]
    theirs = sorted({(x.process, x.address) for x in listeners if x.process.startswith(LAUNCHER_PROCESSES)})
    print(f"{flavor}: gpucomm-run, wrappers and ranks listen on {sorted({x.address for x in ours})}; the MPI "
          f"launcher's own processes on {theirs}")
    assert ours, listeners  # gpucomm-run's store and rank channel at least
    assert [x for x in ours if not x.loopback] == [], listeners
    assert job.leftovers == []


def test_mpi_is_told_the_interface_gpucomm_chose():
    lo = loopback_interface()
    assert binding_interface(["localhost", "localhost"], None) == lo
    assert binding_interface(["localhost", "node2"], None) is None  # several hosts: MPI's own choice (docs: security)
    assert binding_interface(["node1", "node2"], "eth1") == "eth1"
    one_host = binding_environment(lo, local_only=True, env={})
    assert one_host == {"FI_TCP_IFACE": lo, "FI_SOCKETS_IFACE": lo, "MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE": lo,
                        "UCX_NET_DEVICES": lo}
    hosts = binding_environment("eth1", local_only=False, env={"FI_TCP_IFACE": "ib0"})
    assert hosts == {"FI_SOCKETS_IFACE": "eth1", "MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE": "eth1"}  # the user's kept
    assert binding_environment(None, local_only=False, env={}) == {}

    mpich = launcher_argv(MpiLauncher("/v/mpiexec", "mpich", "Hydra 5"), ["localhost"] * 2, ["t"], {}, nic=lo,
                          local_only=True)
    assert mpich == ["/v/mpiexec", "-n", "2", "-hosts", "localhost:2", "-iface", lo, "t"]
    ompi = MpiLauncher("/x/mpirun", "openmpi", "4.1")
    argv = launcher_argv(ompi, ["localhost"] * 2, ["t"], {}, nic=lo, local_only=True)
    mca = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--mca"}
    assert mca == {"oob_tcp_if_include": lo, "btl_tcp_if_include": lo, "btl": "^tcp,ofi,uct,usnic,openib"}
    argv = launcher_argv(ompi, ["localhost"] * 2, ["t"], {"OMPI_MCA_btl": "self,vader"}, nic=lo, local_only=True,
                         extra=["--mca", "btl_tcp_if_include", "eth0"])
    assert "^tcp" not in argv and argv.count("btl_tcp_if_include") == 1  # what the user set stays theirs


# ---------------------------------------------------------------------------------------------
# blame, as gpucomm-run's own launcher decides it


def test_blame_names_the_killed_rank_over_the_echoes_the_others_reported():
    ends = [RankEnd(0, 1, "h1", None, 9), RankEnd(1, 0, "h0", 1, None), RankEnd(2, 2, "h2", None, None)]
    echoes = [Failure(0, 0, "h0", "CollectiveError: rank 1 exited or crashed without shutting gpucomm down")]
    found = blame(ends, echoes)
    assert (found.rank, found.host, found.code) == (1, "h1", 137) and "killed by SIGKILL" in found.how


def test_blame_takes_the_first_reported_error_and_its_ranks_own_code():
    ends = [RankEnd(0, 0, "h0", 1, None), RankEnd(1, 1, "h1", 3, None)]
    reported = [Failure(0, 1, "h1", "ValueError: rank 1 gave up"), Failure(1, 0, "h0", "CollectiveError: rank 1")]
    found = blame(ends, reported)
    assert (found.rank, found.code) == (1, 3) and found.lines == ["rank 1 on h1 failed first: ValueError: rank 1 gave up"]


def test_blame_ignores_what_ended_once_the_job_was_being_stopped():
    stopped = [RankEnd(0, 0, "h0", None, 15, after_release=True)]
    assert blame(stopped, []) is None
    reported = [Failure(0, 1, "h1", "RuntimeError: broke")]
    assert (blame(stopped, reported).rank, blame(stopped, reported).code) == (1, 1)
    assert blame([RankEnd(0, 2, "?", None, None)], []).rank == 2  # only a rank that vanished: it is named
    assert blame([RankEnd(0, 0, "h", 0, None)], []) is None
