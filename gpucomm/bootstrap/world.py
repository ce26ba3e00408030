"""Who am I: turn a launcher's environment into a frozen :class:`World` record.

:func:`detect_world` is a pure function of an environment mapping; its only I/O
is ``socket.gethostname()`` when neither the caller nor the launcher names the
host.  Launchers are tried in a fixed order (gpucomm-run, Horovod, torchrun,
Open MPI, MPICH/Intel MPI, Slurm step) and the first whose marker variable is
present wins; without any, the process is a single-rank job ("none").
Every inconsistency raises :class:`WorldError` naming the variables involved.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, replace
from typing import Callable, Mapping, NamedTuple

from .slurm import SlurmSyntaxError, expand_slurm_nodelist, parse_slurm_tasks_per_node
from ..errors import WorldError
from .launch_env import (GPUCOMM_HOSTNAME, GPUCOMM_RENDEZVOUS_ADDR, GPUCOMM_RENDEZVOUS_HOSTED, GPUCOMM_RENDEZVOUS_PORT,
                         GPUCOMM_RUN_ID, GPUCOMM_SECRET, HOROVOD_HOSTNAME, OMPI_RANK, OMPI_SIZE, PMI_RANK, PMI_SIZE,
                         hydra_job_id, mpi_launcher)
from .netaddr import unbracket
from .placement import Placement

__all__ = [
    "World", "WorldError", "LauncherVars", "detect_world", "derive_port",
    "expand_slurm_nodelist", "parse_slurm_tasks_per_node",
]

# gpucomm's own variables (exported by gpucomm-run; the local and cross counts, GPUCOMM_HOSTNAME and the
# rendezvous variables of gpucomm.bootstrap.launch_env also act as overrides under every other launcher).
GPUCOMM_RANK = "GPUCOMM_RANK"
GPUCOMM_SIZE = "GPUCOMM_SIZE"
GPUCOMM_LOCAL_RANK = "GPUCOMM_LOCAL_RANK"
GPUCOMM_LOCAL_SIZE = "GPUCOMM_LOCAL_SIZE"
GPUCOMM_CROSS_RANK = "GPUCOMM_CROSS_RANK"
GPUCOMM_CROSS_SIZE = "GPUCOMM_CROSS_SIZE"
HOROVOD_GLOO_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_GLOO_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
OMPI_JOBID = "OMPI_MCA_ess_base_jobid"
PMIX_NAMESPACE = "PMIX_NAMESPACE"
SLURM_STEP_ID_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
SLURM_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
SLURM_NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
SLURM_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
SLURM_JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
SLURM_DISTRIBUTION = "SLURM_DISTRIBUTION"

MIN_SECRET_BYTES = 16
DERIVED_PORT_BASE = 20000
# derived ports lie in [20000, 32768): below Linux's default range of ephemeral ports (32768-60999), where any
# outgoing connection on the host may hold the port (seen: a derived 35694 taken while rank 0 started)
DERIVED_PORT_SPAN = 12768
LOOPBACK = "127.0.0.1"
_SECRET_LABEL = b"gpucomm-derived-secret-v1"
_PORT_LABEL = b"gpucomm-rendezvous-port-v1"


class LauncherVars(NamedTuple):
    """Names of the count variables one launcher exports (None: not exported)."""

    rank: str
    size: str
    local_rank: str | None
    local_size: str | None
    cross_rank: str | None = None
    cross_size: str | None = None


GPUCOMM_VARS = LauncherVars(GPUCOMM_RANK, GPUCOMM_SIZE, GPUCOMM_LOCAL_RANK,
                            GPUCOMM_LOCAL_SIZE, GPUCOMM_CROSS_RANK, GPUCOMM_CROSS_SIZE)
HOROVOD_VARS = LauncherVars("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                            "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
TORCHRUN_VARS = LauncherVars("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "GROUP_RANK", None)
OMPI_VARS = LauncherVars(OMPI_RANK, OMPI_SIZE,
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
PMI_VARS = LauncherVars(PMI_RANK, PMI_SIZE, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # MPICH's Hydra (and Intel MPI's)
PMI_LOCAL_VARS = LauncherVars(PMI_RANK, PMI_SIZE, "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")  # Cray PALS, Slurm's cray_shasta
SLURM_VARS = LauncherVars("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                          "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NUM_NODES")


@dataclass(frozen=True)
class World:
    """Where this process sits in the job (its ``Placement``) and how to reach the bootstrap store."""

    placement: Placement
    launcher: str
    rendezvous_addr: str | None
    rendezvous_port: int | None
    rendezvous_hosted: bool
    port_via_torch_store: bool
    secret: bytes | None
    secret_source: str
    run_id: str

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def size(self) -> int:
        return self.placement.size

    @property
    def local_rank(self) -> int:
        return self.placement.local_rank

    @property
    def local_size(self) -> int:
        return self.placement.local_size

    @property
    def cross_rank(self) -> int | None:
        return self.placement.cross_rank

    @property
    def cross_size(self) -> int | None:
        return self.placement.cross_size

    @property
    def hostname(self) -> str:
        return self.placement.host


# ---------------------------------------------------------------- small readers

def _get(env: Mapping[str, str], name: str) -> str | None:
    """Value of ``name`` stripped, or None when unset or blank."""
    value = env.get(name)
    return (value.strip() or None) if value is not None else None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    """(name, value) of the first of ``names`` that is set; the first name if none is."""
    for name in names:
        value = _get(env, name)
        if value is not None:
            return name, value
    return names[0], None


def _to_int(name: str, value: str | None) -> int:
    """Parse a decimal integer, blaming ``name`` when it is missing or malformed."""
    if value is None:
        raise WorldError(f"{name} is not set: the launcher must state it. A wrapper "
                         f"script probably dropped it from the environment; pass it through.")
    try:
        return int(value)
    except ValueError:
        raise WorldError(f"{name}={value!r} is not an integer: it must be a whole number. "
                         f"It was probably mangled by a wrapper script or set by hand; "
                         f"export a plain decimal integer or unset it.") from None


def _opt_int(env: Mapping[str, str], name: str | None) -> int | None:
    return None if name is None or _get(env, name) is None else _to_int(name, _get(env, name))


def _port(name: str, value: str | None) -> int | None:
    """Parse a TCP port (None when unset) and check it lies in 1..65535."""
    if value is None:
        return None
    port = _to_int(name, value)
    if not 1 <= port <= 65535:
        raise WorldError(f"{name}={port} is not a TCP port: it must be in 1..65535. Set it "
                         f"to a free port on the rendezvous host.")
    return port


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = (_get(env, name) or "0").lower()
    if value not in ("0", "1", "false", "true", "no", "yes"):
        raise WorldError(f"{name}={value!r} is not a boolean: use 1 or 0.")
    return value in ("1", "true", "yes")


def _secret_from_env(env: Mapping[str, str]) -> bytes | None:
    """Decode GPUCOMM_SECRET (hex, >= 16 bytes); the value is never echoed back."""
    text = _get(env, GPUCOMM_SECRET)
    if text is None:
        return None
    fix = ("generate one with `python -c 'import secrets; print(secrets.token_hex(32))'` "
           "and export the same value to every rank")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise WorldError(f"{GPUCOMM_SECRET} is not a hex string ({len(text)} characters): "
                         f"the job secret must be hex-encoded bytes; {fix}.") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise WorldError(f"{GPUCOMM_SECRET} decodes to {len(secret)} bytes: at least "
                         f"{MIN_SECRET_BYTES} are needed for HMAC keys; {fix}.")
    return secret


def _hostname(env: Mapping[str, str], var: str | None, hostname: str | None) -> str:
    """Launcher-stated host name, else the caller's, else the kernel's."""
    stated = _get(env, var) if var else None
    return stated or hostname or socket.gethostname()


# ---------------------------------------------------------------- public helpers

def derive_port(run_id: str) -> int:
    """Deterministic rendezvous port in [20000, 32768) for a job id.

    Every rank of a job computes the same port without communicating: the first
    8 bytes of SHA-256(label + run_id) modulo 12768, plus 20000, which keeps it
    below Linux's default ephemeral range (32768-60999), whose ports any outgoing
    connection may hold.  Collisions with other services are possible; set
    GPUCOMM_RENDEZVOUS_PORT to override.
    """
    digest = hashlib.sha256(_PORT_LABEL + b"\0" + run_id.encode()).digest()
    return DERIVED_PORT_BASE + int.from_bytes(digest[:8], "big") % DERIVED_PORT_SPAN


def _derive_secret(run_id: str, addr: str, port: int) -> bytes:
    """Job secret every rank can compute: guards integrity, not authenticity."""
    material = b"\0".join([_SECRET_LABEL, run_id.encode(), addr.encode(), str(port).encode()])
    return hashlib.sha256(material).digest()


# ---------------------------------------------------------------- validation

def _check_counts(c: Placement, v: LauncherVars) -> None:
    """Check the rank/size invariants, naming the launcher's variables."""
    cause = ("The launcher and the script disagree on the job layout (a stale variable "
             "left in the shell, or a wrapper overriding one value but not the other); "
             "unset stale variables and let the launcher set all of them.")
    if c.size < 1:
        raise WorldError(f"{v.size}={c.size} is below 1: a job has at least one process. {cause}")
    if not 0 <= c.rank < c.size:
        raise WorldError(f"{v.rank}={c.rank} is not below {v.size}={c.size}: every rank must "
                         f"satisfy 0 <= rank < size. {cause}")
    if not 1 <= c.local_size <= c.size:
        raise WorldError(f"{v.local_size}={c.local_size} is not in 1..{v.size}={c.size}: a host "
                         f"runs at least one and at most all ranks. {cause}")
    if not 0 <= c.local_rank < c.local_size:
        raise WorldError(f"{v.local_rank}={c.local_rank} is not below {v.local_size}="
                         f"{c.local_size}: every local rank must satisfy 0 <= local_rank "
                         f"< local_size. {cause}")
    if c.cross_rank is not None and c.cross_size is not None \
            and not 0 <= c.cross_rank < c.cross_size:
        raise WorldError(f"{v.cross_rank}={c.cross_rank} is not below {v.cross_size}="
                         f"{c.cross_size}: every node index must satisfy 0 <= cross_rank "
                         f"< cross_size. {cause}")


def _read_counts(env: Mapping[str, str], v: LauncherVars) -> Placement:
    """Read and check the six counts a launcher exports under the names in ``v``."""
    c = Placement("", _to_int(v.rank, _get(env, v.rank)), _to_int(v.size, _get(env, v.size)),
                  _to_int(str(v.local_rank), _get(env, str(v.local_rank))),
                  _to_int(str(v.local_size), _get(env, str(v.local_size))),
                  _opt_int(env, v.cross_rank), _opt_int(env, v.cross_size))
    _check_counts(c, v)
    return c


def _missing_addr(c: Placement, v: LauncherVars, what: str, how: str) -> WorldError:
    return WorldError(f"No rendezvous address for a {c.size}-rank job ({v.size}={c.size}, "
                      f"{v.local_size}={c.local_size}): every rank must reach rank 0's "
                      f"bootstrap store, and {what}. Set {how}.")


# ---------------------------------------------------------------- launchers

def _make_world(c: Placement, launcher: str, host: str, addr: str | None, port: int | None,
           env: Mapping[str, str], secret: bytes | None, source: str, run_id: str,
           via_store: bool = False) -> World:
    addr = unbracket(addr) if addr is not None else None  # (an IPv6 address may come written as in a URL)
    return World(replace(c, host=host), launcher, addr, port, _flag(env, GPUCOMM_RENDEZVOUS_HOSTED),
                 via_store, secret, source, run_id)


def _finish(env: Mapping[str, str], c: Placement, v: LauncherVars, launcher: str, host: str,
            run_id: str, addr: str | None = None, port: int | None = None,
            how: str = GPUCOMM_RENDEZVOUS_ADDR + "=<rank 0's host>") -> World:
    """Apply GPUCOMM_* overrides and defaults shared by Horovod, MPI and Slurm."""
    run_id = _get(env, GPUCOMM_RUN_ID) or run_id
    addr = _get(env, GPUCOMM_RENDEZVOUS_ADDR) or addr
    if addr is None and c.local_size != c.size:
        raise _missing_addr(c, v, "the ranks span several hosts", how)
    addr = addr or LOOPBACK
    port = _port(GPUCOMM_RENDEZVOUS_PORT, _get(env, GPUCOMM_RENDEZVOUS_PORT)) or port
    port = port or derive_port(run_id)
    secret = _secret_from_env(env)
    if secret is not None:
        return _make_world(c, launcher, host, addr, port, env, secret, "env", run_id)
    return _make_world(c, launcher, host, addr, port, env, _derive_secret(run_id, addr, port),
                  "derived", run_id)


def _gpucomm(env: Mapping[str, str], hostname: str | None) -> World | None:
    if GPUCOMM_RANK not in env:
        return None
    c = _read_counts(env, GPUCOMM_VARS)
    addr = _get(env, GPUCOMM_RENDEZVOUS_ADDR)
    port = _port(GPUCOMM_RENDEZVOUS_PORT, _get(env, GPUCOMM_RENDEZVOUS_PORT))
    secret, run_id = _secret_from_env(env), _get(env, GPUCOMM_RUN_ID) or ""
    if c.size > 1 and (addr is None or port is None):
        raise _missing_addr(c, GPUCOMM_VARS, "gpucomm-run always exports the store's "
                            "address and port", f"both {GPUCOMM_RENDEZVOUS_ADDR} and "
                            f"{GPUCOMM_RENDEZVOUS_PORT}, or launch with gpucomm-run")
    if c.size > 1 and secret is None:
        raise WorldError(f"{GPUCOMM_SECRET} is not set for a {c.size}-rank gpucomm-run job: "
                         f"bootstrap frames are HMAC-signed with it. Launch with gpucomm-run, "
                         f"which exports it, or export the same hex secret to every rank.")
    host = _hostname(env, GPUCOMM_HOSTNAME, hostname)
    addr, port = addr or LOOPBACK, port or derive_port(run_id)
    return _make_world(c, "gpucomm", host, addr, port, env, secret,
                  "env" if secret else "random", run_id)


def _horovod(env: Mapping[str, str], hostname: str | None) -> World | None:
    if HOROVOD_VARS.rank not in env:
        return None
    c = _read_counts(env, HOROVOD_VARS)
    port = _port(HOROVOD_GLOO_RENDEZVOUS_PORT, _get(env, HOROVOD_GLOO_RENDEZVOUS_PORT))
    return _finish(env, c, HOROVOD_VARS, "horovod", _hostname(env, HOROVOD_HOSTNAME, hostname),
                   "", _get(env, HOROVOD_GLOO_RENDEZVOUS_ADDR), port)


def _torchrun(env: Mapping[str, str], hostname: str | None) -> World | None:
    v = TORCHRUN_VARS
    if v.rank not in env or v.size not in env:
        return None
    if _get(env, str(v.local_rank)) is None or _get(env, str(v.local_size)) is None:
        raise WorldError(f"{v.rank} and {v.size} are set but {v.local_rank}/{v.local_size} "
                         f"are not: gpucomm needs the per-host layout to pick a GPU. Launch "
                         f"with torchrun, or export {v.local_rank} and {v.local_size} too.")
    # the cross rank and size come from the arrival records (``cross_placement``): torchrun's nodes may run
    # different numbers of ranks (--nproc-per-node per node), and GROUP_RANK is the node's index, not the index
    # among the nodes that run this local rank (Horovod's cross rank)
    c = _read_counts(env, v._replace(cross_rank=None))
    addr = _get(env, GPUCOMM_RENDEZVOUS_ADDR) or _get(env, MASTER_ADDR)
    own_port = _port(GPUCOMM_RENDEZVOUS_PORT, _get(env, GPUCOMM_RENDEZVOUS_PORT))
    port = own_port or _port(MASTER_PORT, _get(env, MASTER_PORT))
    if c.size > 1 and (addr is None or port is None):
        raise _missing_addr(c, v, "torchrun always exports MASTER_ADDR and MASTER_PORT",
                            f"{MASTER_ADDR} and {MASTER_PORT} (torchrun does this), or "
                            f"{GPUCOMM_RENDEZVOUS_ADDR} and {GPUCOMM_RENDEZVOUS_PORT}")
    run_id = _get(env, GPUCOMM_RUN_ID) or _get(env, TORCHELASTIC_RUN_ID) or ""
    addr, port = addr or LOOPBACK, port or derive_port(run_id)
    secret = _secret_from_env(env)
    return _make_world(c, "torchrun", _hostname(env, None, hostname), addr, port, env, secret,
                  "env" if secret else "torch-store", run_id, via_store=own_port is None)


def _openmpi(env: Mapping[str, str], hostname: str | None) -> World | None:
    if mpi_launcher(env) != "openmpi" or OMPI_VARS.rank not in env:
        return None
    c = _read_counts(env, OMPI_VARS)
    run_id = _get(env, OMPI_JOBID) or _get(env, PMIX_NAMESPACE) or ""
    how = f"{GPUCOMM_RENDEZVOUS_ADDR}=<rank 0's host> and pass it with `mpirun -x " \
          f"{GPUCOMM_RENDEZVOUS_ADDR}`"
    return _finish(env, c, OMPI_VARS, "openmpi", _hostname(env, None, hostname), run_id,
                   how=how)


def _mpich(env: Mapping[str, str], hostname: str | None) -> World | None:
    if mpi_launcher(env) != "mpich" or PMI_VARS.rank not in env:
        return None
    v = PMI_VARS
    if str(v.local_rank) not in env:  # not Hydra's (MPICH's, Intel MPI's mpiexec): its local variables are absent
        if _slurm_step(env):
            # srun's PMI plugins (--mpi=pmi2, a site's MpiDefault=pmi2, HPE's cray_shasta) set PMI_RANK and
            # PMI_SIZE too: Slurm's own variables give the whole world
            return None
        if PMI_LOCAL_VARS.local_rank in env:  # Cray PALS and cray_shasta: PMI_LOCAL_RANK, PMI_LOCAL_SIZE
            v = PMI_LOCAL_VARS
    c = _read_counts(env, v)
    how = f"{GPUCOMM_RENDEZVOUS_ADDR}=<rank 0's host> and pass it with `mpiexec " \
          f"-genv {GPUCOMM_RENDEZVOUS_ADDR} <host>`"
    # Hydra exports no job id, and a job's port and derived secret come from it: with none, two jobs whose rank 0
    # shared a host met at one port (the second joined the first's store, and the first failed: 'two processes
    # claim rank 0'). mpiexec's own address, which every proxy of its job is started with, tells them apart, also
    # two mpiexec runs of one Slurm allocation; it comes from the process tree, not from variables that a launch
    # may forward to some hosts only (GPUCOMM_RUN_ID, read in _finish, wins)
    run_id = "" if _get(env, GPUCOMM_RUN_ID) else hydra_job_id()
    return _finish(env, c, v, "mpich", _hostname(env, None, hostname), run_id, how=how)


def _slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (a bare sbatch batch shell has SLURM_PROCID but no step)."""
    return SLURM_VARS.rank in env and any(n in env for n in SLURM_STEP_ID_VARS)


def _slurm(env: Mapping[str, str], hostname: str | None) -> World | None:
    step = _first(env, SLURM_STEP_ID_VARS)[1] or ""
    if not _slurm_step(env):
        return None
    size_var, _ = _first(env, SLURM_SIZE_VARS)
    nodes_var, _ = _first(env, SLURM_NNODES_VARS)
    tpn_var, tpn = _first(env, SLURM_TASKS_PER_NODE_VARS)
    v = SLURM_VARS._replace(size=size_var, cross_size=nodes_var, local_size=tpn_var)
    node = _to_int(str(v.cross_rank), _get(env, str(v.cross_rank)))
    if tpn is None:
        raise WorldError(f"{tpn_var} is not set: gpucomm needs the tasks per node to know "
                         f"how many ranks share this host. Run the script inside `srun`.")
    try:
        per_node = parse_slurm_tasks_per_node(tpn)
    except SlurmSyntaxError as e:
        raise WorldError(f"{tpn_var}: {e}") from None
    if not 0 <= node < len(per_node):
        raise WorldError(f"{v.cross_rank}={node} has no entry in {tpn_var}={tpn!r}: the step's "
                         f"tasks-per-node list must cover every node. Unset stale Slurm "
                         f"variables or run inside `srun`.")
    layout = {**env, tpn_var: str(per_node[node])}
    c = _read_counts(layout, v)
    # Horovod's cross rank and size: this node's index among the nodes that run a task of this local rank, and
    # their number (uneven tasks per node, "2,1": local rank 1 runs on one node only). Tasks of one local rank
    # are in node order under srun's block, cyclic and plane distributions; under -m arbitrary they need not
    # be, so the arrival records decide (``cross_placement``)
    arbitrary = _arbitrary_distribution(env)
    c = replace(c, cross_rank=None if arbitrary else sum(1 for n in per_node[:node] if n > c.local_rank),
                cross_size=None if arbitrary else sum(1 for n in per_node if n > c.local_rank))
    list_var, nodelist = _first(env, SLURM_NODELIST_VARS)
    try:
        addr = expand_slurm_nodelist(nodelist)[0] if nodelist else None
    except SlurmSyntaxError as e:
        raise WorldError(f"{list_var}: {e}") from None
    how = f"{list_var} (srun does this) or {GPUCOMM_RENDEZVOUS_ADDR}"
    if arbitrary and c.local_size != c.size:
        # srun -m arbitrary puts task i on the i-th host of SLURM_HOSTFILE, and the node list is sorted:
        # its first host need not run task 0 (seen: task 0 on node1 of node[0-1], its store bound to
        # node0's address failed while the other ranks waited for it until the start timeout)
        addr = None
        how = (f"{GPUCOMM_RENDEZVOUS_ADDR} to task 0's host: {SLURM_DISTRIBUTION}=arbitrary places task i on "
               f"the i-th host of SLURM_HOSTFILE, so the first host of {list_var} need not be task 0's "
               f"(export GPUCOMM_RENDEZVOUS_ADDR=$(head -n1 \"$SLURM_HOSTFILE\") before srun)")
    job_id = _first(env, SLURM_JOB_ID_VARS)[1] or ""
    return _finish(env, c, v, "slurm", _hostname(env, None, hostname), f"{job_id}.{step}", addr, how=how)


def _arbitrary_distribution(env: Mapping[str, str]) -> bool:
    """Whether srun placed the tasks by a host file (``-m arbitrary``) rather than in node-list order."""
    method = (_get(env, SLURM_DISTRIBUTION) or "").lower()
    return method.split(":")[0].split(",")[0] == "arbitrary"


def _single(env: Mapping[str, str], hostname: str | None) -> World:
    return World(Placement(_hostname(env, None, hostname), 0, 1, 0, 1, 0, 1), "none", None, None,
                 False, False, None, "random", "")


_DETECTORS: tuple[Callable[[Mapping[str, str], str | None], World | None], ...] = (
    _gpucomm, _horovod, _torchrun, _openmpi, _mpich, _slurm)


def detect_world(env: Mapping[str, str] | None = None, hostname: str | None = None) -> World:
    """Describe this process's place in the job from launcher environment variables.

    ``env`` defaults to ``os.environ``; ``hostname`` is used when the launcher does
    not state one, else ``socket.gethostname()``.  Raises WorldError on any
    inconsistency, with the variables to fix.
    """
    env = os.environ if env is None else env
    for detect in _DETECTORS:
        world = detect(env, hostname)
        if world is not None:
            return world
    return _single(env, hostname)
