"""A Slurm cluster in a box: Debian's ``slurm-wlm`` daemons (munged, slurmctld, slurmd) started as root
from a temporary directory, for tests that submit real jobs with ``sbatch`` and ``srun``.

``slurm_cluster()`` yields a ``SlurmCluster`` whose one node is this machine (its short host name, at
127.0.0.1); ``slurm_cluster(hosts=...)`` makes one node per namespace host of ``tests/cluster.py``
instead (munged and slurmctld on the first). Nothing global is installed, configured or left behind:

* everything lives in one temporary directory: ``slurm.conf`` (found by every daemon and client through
  ``SLURM_CONF``), munge's key, socket and seed, the controller's state, each node's spool, pid files
  and logs; the directory is removed at the end, also when a test failed;
* munged runs with that key and socket (``AuthInfo=socket=...``), so a system munged, if any, is not
  touched; slurmctld and slurmd listen on free ports;
* tasks are tracked by ``proctrack/linuxproc`` (process parentage) with ``task/none``: the cgroup
  plugins work in some containers but create ``/sys/fs/cgroup/*/slurm_<node>`` directories, which
  would outlive the cluster (``cgroup.conf`` only names the plugin slurmd insists on loading); a node
  claims more CPUs than the machine may have (``SlurmdParameters=config_overrides``), so a 2-task job
  fits on a 2-core runner;
* tear-down cancels every job still known to the controller, stops the daemons with SIGTERM, kills
  what remains (what carries a daemon's ``harness.started`` mark, and any process, slurmstepd above
  all, that holds a file of the cluster's directory open) and lists it in ``SlurmCluster.leftovers``,
  which a test asserts empty.

Client commands run through ``SlurmCluster.run``/``started`` (``tests/harness.py``: a deadline, reaping,
leftovers by mark; a job's tasks carry the mark of the ``sbatch``/``srun`` that submitted it, because
Slurm exports the submitter's environment to them). ``SLURM_*`` variables of the process running the
tests (a CI job that itself runs under Slurm) are removed from every command, so they never point a
client at another cluster's job. ``unavailable()`` says why a cluster cannot be made here (not root,
binaries missing, a host name that does not resolve); tests skip with that reason, and run only when
asked for (``-m slurm`` or ``GPUCOMM_TEST_SLURM=1``; ``.ci/slurm_step.sh`` does).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import psutil

from tests.harness import Result, free_port, run, started
from tests.steps import selected

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
LIFETIME = 3600.0  # seconds a daemon may run before the harness kills it (one test module's cluster, at most)
START_TIMEOUT = 60.0  # seconds the daemons get to bring every node up idle
STOP_TIMEOUT = 10.0  # seconds a daemon gets to exit on SIGTERM
CLIENT_TIMEOUT = 30.0  # seconds a short client command (sinfo, scontrol, scancel) may take
NODE_CPUS = 4  # CPUs each node claims, whatever the machine has: 2 tasks fit, and a second job beside them
ENDED_STATES = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT")
# slurmd 22.05 always loads a cgroup plugin, even with proctrack/linuxproc and task/none, and its autodetection
# fails where /sys/fs/cgroup holds no cgroup file system (a namespace host: `ip netns exec` mounts a fresh /sys).
# The v1 plugin loads without one (seen with 22.05.8); nothing here asks it to make a cgroup, so none is made.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"
_INHERITED = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")


class SlurmError(RuntimeError):
    """The cluster could not be started or queried; the message holds the command, its output and the logs."""


def slurm_selected(config: Any) -> bool:
    """Whether this pytest run asked for the Slurm tests (``-m slurm``, or ``GPUCOMM_TEST_SLURM=1``): they
    start daemons as root and real jobs, so the main run leaves them to their own CI step."""
    return selected(config, "slurm")


def require_slurm(config: Any) -> None:
    """Skip the calling test (or fixture), with the reason, unless Slurm was asked for and can run here."""
    import pytest  # noqa: PLC0415 - only tests call this

    if not slurm_selected(config):
        pytest.skip("Slurm tests run in their own step: `python -m pytest -m slurm tests/test_slurm.py` as root "
                    "(.ci/slurm_step.sh does), or set GPUCOMM_TEST_SLURM=1")
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"cannot start a Slurm cluster here: {reason}")


def node_name() -> str:
    """This machine's node name: its short host name, as slurmd names itself by default."""
    return socket.gethostname().split(".")[0]


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why a Slurm cluster cannot be started on this machine, or None when it can (asked once per process)."""
    if os.geteuid() != 0:
        return "the daemons run as root (SlurmUser=root): run the Slurm tests as root, as .ci/slurm_step.sh does"
    for tool in DAEMONS + CLIENTS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool!r} is not installed (apt-get install slurm-wlm munge; .ci/slurm_step.sh does this)"
    try:
        socket.getaddrinfo(node_name(), None)
    except OSError as e:
        return (f"this machine's name {node_name()!r} does not resolve ({e}): Slurm's node list names it, and "
                f"gpucomm's ranks reach the store through that name; add it to /etc/hosts")
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass(frozen=True)
class SlurmNode:
    """One node: its Slurm name (what node lists say), the address slurmctld reaches its slurmd at, and the
    namespace host it runs on (``tests/cluster.py``; None: this machine's own network)."""

    name: str
    address: str
    host: Any = None


@dataclass(frozen=True)
class JobEnd:
    """How a job ended: its final ``scontrol`` record, and every state it was seen in with the wall-clock
    time (``time.time()``) it was first seen, polled every ``SlurmCluster.POLL`` s."""

    job_id: str
    record: dict[str, str]
    states: list[tuple[float, str]]

    @property
    def state(self) -> str:
        return self.record.get("JobState", "")

    @property
    def exit_code(self) -> int:
        """The batch script's (or srun's) exit status, from ``ExitCode=status:signal``."""
        return int(self.record.get("ExitCode", "0:0").split(":")[0])

    @property
    def signal(self) -> int:
        return int(self.record.get("ExitCode", "0:0").split(":")[1])

    def first_seen(self, *states: str) -> float | None:
        """When the job was first seen in one of ``states`` (None: never)."""
        return next((t for t, s in self.states if s in states), None)


def slurm_conf(tmp: Path, nodes: Sequence[SlurmNode], ctld_port: int, slurmd_port: int, cpus: int = NODE_CPUS) -> str:
    """The cluster's slurm.conf: controller on ``nodes[0]``, one partition over every node, all state under ``tmp``.

    No accounting (``sacct`` needs slurmdbd; ``scontrol show job`` keeps a job's record ``MinJobAge`` s after it
    ends); ``KillWait`` is short so cancelling a job that ignores SIGTERM stays quick at tear-down."""
    node_lines = "\n".join(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes)
    return textwrap.dedent(f"""\
        ClusterName=gpucomm-test
        SlurmctldHost={nodes[0].name}({nodes[0].address})
        SlurmctldPort={ctld_port}
        SlurmdPort={slurmd_port}
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        CredType=cred/munge
        AuthInfo=socket={tmp / 'munge.socket'}
        StateSaveLocation={tmp / 'state'}
        SlurmdSpoolDir={tmp / 'spool'}/%n
        SlurmctldPidFile={tmp / 'slurmctld.pid'}
        SlurmdPidFile={tmp / 'slurmd-%n.pid'}
        SlurmctldLogFile={tmp / 'log' / 'slurmctld.log'}
        SlurmdLogFile={tmp / 'log' / 'slurmd-%n.log'}
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_CPU
        SlurmdParameters=config_overrides
        MpiDefault=none
        JobAcctGatherType=jobacct_gather/none
        AccountingStorageType=accounting_storage/none
        JobCompType=jobcomp/none
        MailProg=/bin/true
        ReturnToService=2
        InactiveLimit=0
        KillWait=10
        MinJobAge=600
        {node_lines}
        PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
    """)


@dataclass
class SlurmCluster:
    """A running cluster; see the module's docstring. ``start_seconds``/``stop_seconds``: how long starting
    and tearing it down took; ``leftovers``: processes that had to be killed at tear-down (filled then)."""

    tmp: Path
    nodes: list[SlurmNode]
    start_seconds: float = 0.0
    stop_seconds: float = 0.0
    leftovers: list[str] = field(default_factory=list)
    daemons: dict[str, Any] = field(default_factory=dict)  # name -> harness Started
    POLL = 0.1  # seconds between a waiting test's looks at a job

    @property
    def conf(self) -> Path:
        return self.tmp / "slurm.conf"

    @property
    def submit_host(self) -> Any:
        """The namespace host client commands run on (the controller's), or None for this machine."""
        return self.nodes[0].host

    def env(self, **extra: str) -> dict[str, str]:
        """What every client command gets on top of the test defaults: this cluster's ``SLURM_CONF``, and the
        venv's ``bin`` first on ``PATH`` so that ``python`` in a job is the interpreter running the tests."""
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        return {"SLURM_CONF": str(self.conf), "PATH": path, **extra}

    def argv(self, cmd: Sequence[str], host: Any = None) -> list[str]:
        """``cmd`` without inherited Slurm variables, on ``host`` (default: the submit host)."""
        unset = [arg for name in sorted(os.environ) if name.startswith(_INHERITED) and name != "SLURM_CONF"
                 for arg in ("-u", name)]
        full = ["env", *unset, *map(str, cmd)]
        host = host or self.submit_host
        return host.argv(full) if host is not None else full

    def run(self, cmd: Sequence[str], *, timeout: float = 180.0, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Result:
        """``harness.run`` of a client command (``sbatch --wait``, ``srun``) against this cluster."""
        return run(self.argv(cmd), timeout=timeout, env=self.env(**(env or {})), cwd=cwd)

    def started(self, cmd: Sequence[str], *, timeout: float = 300.0, env: dict[str, str] | None = None,
                cwd: Path | None = None):
        """``harness.started`` of a client command; the processes of a job it submits carry its mark, so
        the block's ``leftovers`` name any task that outlived the job."""
        return started(self.argv(cmd), timeout=timeout, env=self.env(**(env or {})), cwd=cwd)

    def query(self, *cmd: str, timeout: float = CLIENT_TIMEOUT) -> str:
        """The output of a short client command (``scontrol``, ``sinfo``, ``squeue``, ``scancel``); raises
        SlurmError naming the command and its error when it fails."""
        full = self.argv(cmd)
        try:
            done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                                  env=dict(os.environ, **self.env()))
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(cmd)} did not answer in {timeout:g} s: slurmctld is stuck or gone."
                             f"\n{self.logs()}") from None
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """The controller's record of a job (``scontrol show job -o``) as ``{field: value}``."""
        text = self.query("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w[\w:/]*)=(\S*)", text))

    def wait_job(self, job_id: str, timeout: float) -> JobEnd:
        """Poll a job until it has ended (``ENDED_STATES``), recording each state as first seen. A job still
        not ended at ``timeout`` is cancelled and fails the test (a hang), with its record and the logs."""
        deadline = time.monotonic() + timeout
        states: list[tuple[float, str]] = []
        while True:
            record = self.job(job_id)
            state = record.get("JobState", "?")
            if not states or states[-1][1] != state:
                states.append((time.time(), state))
            if state in ENDED_STATES:
                return JobEnd(job_id, record, states)
            if time.monotonic() >= deadline:
                with contextlib.suppress(SlurmError):
                    self.query("scancel", "--signal=KILL", "--full", job_id)
                raise AssertionError(f"job {job_id} did not end within {timeout:g} s (states seen: {states}); "
                                     f"cancelled. Its record: {record}\n{self.logs()}")
            time.sleep(self.POLL)

    def logs(self, chars: int = 3000) -> str:
        """The end of every daemon's log, for failure messages."""
        parts = []
        for path in sorted((self.tmp / "log").glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts) or "(no daemon logs)"

    # ------------------------------------------------------------------ starting and stopping

    def _daemon(self, stack: contextlib.ExitStack, label: str, cmd: Sequence[str], host: Any = None) -> None:
        """Start one daemon in the foreground under the harness (marked, killed at ``LIFETIME``) on ``host``
        (default: the controller's); its own output (what it says before its log file is open) goes to
        ``log/<label>.out``."""
        out = stack.enter_context(open(self.tmp / "log" / f"{label}.out", "w"))
        handle = stack.enter_context(started(self.argv(cmd, host), stdout=out, stderr=subprocess.STDOUT,
                                             timeout=LIFETIME, inherit_env=True, env=self.env()))
        self.daemons[label] = handle

    def _check_alive(self) -> None:
        for label, handle in self.daemons.items():
            if handle.proc.poll() is not None:
                raise SlurmError(f"{label} exited with status {handle.proc.returncode} while the cluster started; "
                                 f"its log says why:\n{self.logs()}")

    def _wait(self, what: str, ready: Any, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if ready():
                    return
            except SlurmError as e:
                last = str(e)
            time.sleep(0.2)
        raise SlurmError(f"{what} within {START_TIMEOUT:g} s (last error: {last or 'none'}). Likely causes: a "
                         f"port taken, a node name slurmd does not take as its own, munge refusing the key "
                         f"or socket directory.\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        out = self.query("sinfo", "-h", "-N", "-o", "%N %t")
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n.name) == "idle" for n in self.nodes)

    def start(self, stack: contextlib.ExitStack) -> None:
        """Write the files, start munged, slurmctld and one slurmd per node, and wait until every node is idle."""
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT
        self.tmp.chmod(0o755)  # munged checks that every user can reach its socket's directory
        for sub in ("state", "log", *(f"spool/{n.name}" for n in self.nodes)):
            (self.tmp / sub).mkdir(parents=True)
        key = self.tmp / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(slurm_conf(self.tmp, self.nodes, free_port(), free_port()))
        (self.tmp / "cgroup.conf").write_text(CGROUP_CONF)
        self._daemon(stack, "munged", [_binary("munged"), "--foreground", f"--socket={self.tmp / 'munge.socket'}",
                                       f"--key-file={key}", f"--pid-file={self.tmp / 'munged.pid'}",
                                       f"--seed-file={self.tmp / 'munged.seed'}",
                                       f"--log-file={self.tmp / 'log' / 'munged.log'}"])
        self._wait("munged did not open its socket", (self.tmp / "munge.socket").exists, deadline)
        self._daemon(stack, "slurmctld", [_binary("slurmctld"), "-D", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(stack, f"slurmd-{n.name}", [_binary("slurmd"), "-D", "-N", n.name, "-f", str(self.conf)],
                         host=n.host)
        self._wait(f"the nodes {[n.name for n in self.nodes]} did not all come up idle", self._nodes_idle, deadline)
        self.start_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmd first, munged last) with SIGTERM and wait for them; the
        harness then kills whatever of theirs still runs (listed in ``leftovers`` by ``collect``)."""
        t0 = time.monotonic()
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].proc.poll() is None:
            with contextlib.suppress(SlurmError):
                jobs = self.query("squeue", "-h", "-o", "%i").split()
                if jobs:
                    self.query("scancel", "--full", *jobs)
                    deadline = time.monotonic() + 2 * STOP_TIMEOUT
                    while self.query("squeue", "-h", "-o", "%i").split() and time.monotonic() < deadline:
                        time.sleep(0.2)
        for label in sorted(self.daemons, key=lambda name: ("slurmd" not in name, name == "munged")):
            proc = self.daemons[label].proc
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.leftovers.append(f"{label} (pid {proc.pid}) did not exit within {STOP_TIMEOUT:g} s of "
                                          f"SIGTERM; killed")
        self.stop_seconds = time.monotonic() - t0

    def collect(self) -> None:
        """After the harness closed the daemons' handles: what it had to kill, by daemon, and any process
        still holding a file of the cluster's directory open, with its children: slurmstepd keeps slurmd's
        log open but starts with an empty environment, so the harness's mark does not find it."""
        for label, handle in self.daemons.items():
            self.leftovers += [f"started by {label}: {p}" for p in handle.leftovers]
        for p in self._holding_files():
            with contextlib.suppress(psutil.Error):
                family = [p, *p.children(recursive=True)]
                self.leftovers += [f"pid {q.pid}: {' '.join(q.cmdline())}" for q in family]
                for q in family:
                    q.kill()
                psutil.wait_procs(family, timeout=STOP_TIMEOUT)

    def _holding_files(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and any(
                        Path(f.path).is_relative_to(self.tmp) for f in p.open_files()):
                    found.append(p)
        return found


@contextlib.contextmanager
def slurm_cluster(hosts: Sequence[Any] | None = None) -> Iterator[SlurmCluster]:
    """A running Slurm cluster (see the module's docstring), torn down when the block ends, also on failure.
    ``hosts``: namespace hosts of ``tests/cluster.py`` to make one node each (slurmctld and the client
    commands on the first); default one node, this machine."""
    nodes = ([SlurmNode(h.name, h.address, h) for h in hosts] if hosts
             else [SlurmNode(node_name(), "127.0.0.1")])
    with tempfile.TemporaryDirectory(prefix="gpucomm-slurm-") as tmp:
        cluster = SlurmCluster(Path(tmp), nodes)
        try:
            with contextlib.ExitStack() as stack:
                try:
                    cluster.start(stack)
                    yield cluster
                finally:
                    cluster.stop()
        finally:
            cluster.collect()


__all__ = ["JobEnd", "SlurmCluster", "SlurmError", "SlurmNode", "node_name", "require_slurm", "slurm_cluster",
           "slurm_conf", "slurm_selected", "unavailable"]
