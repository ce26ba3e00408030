"""``gpucomm-run --mpi``: start the ranks through an MPI launcher (MPICH's ``mpiexec`` or Open MPI's
``mpirun``) instead of gpucomm-run's own spawning, so that MPI's data plane can carry the job's CPU
collectives (``gpucomm/backends/mpi.py``).

gpucomm-run still serves the job's rendezvous store with a fresh secret and exports the job's
variables (``GPUCOMM_RENDEZVOUS_*``, ``GPUCOMM_SECRET``, the tunables); each rank's place comes from
the MPI launcher's own variables (``PMI_*`` or ``OMPI_COMM_WORLD_*``), which
``gpucomm.bootstrap.world`` reads. Each rank starts as ``mpi_rank.py COMMAND``, which connects its
stdout, stderr and a status connection to gpucomm-run's rank channel (``rank_channel.py``,
authenticated per connection) and runs the command as its child, so output lines carry
gpucomm-run's ``[rank]<stdout>:`` prefixes as always, and gpucomm-run learns how each rank ended:
a failed job is blamed on its rank, and exits with that rank's status (128 + N after signal N), as
under gpucomm-run's own launcher. The secret travels only in the environment (Open MPI's ``-x NAME``
copies it by name), never on a command line.

Where MPI's sockets listen: on the interface gpucomm chose (``--network-interface``, or loopback
when every rank runs on this host), through each MPI's own options and variables
(``binding_interface``, ``binding_environment``, ``launcher_argv``). The MPI launchers' own control
listeners (Hydra's mpiexec, Open MPI's mpirun) bind every interface and cannot be told otherwise.

Which launcher: ``GPUCOMM_MPIEXEC`` if set, else the ``mpiexec`` beside this Python (``pip install
"gpucomm[mpi]"`` puts MPICH's there, matching the library mpi4py loads), else ``mpiexec`` or
``mpirun`` on ``PATH``; its ``--version`` says whether it is MPICH (Hydra) or Open MPI.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from ..bootstrap.launch_env import rendezvous_env
from ..bootstrap.netaddr import host_port, is_ipv6
from ..bootstrap.placement import PLACEMENT_VARS
from ..bootstrap.rendezvous import RendezvousServer
from ..errors import MpiLaunchError
from ..settings import MPIEXEC
from ..failures import Failure, read_failures
from . import proctree
from .output import OutputSink
from .rank_channel import OutputServer, RankEnd, RankEnds
from .spawn import is_local

LAUNCHER_VAR = "GPUCOMM_MPIEXEC"
FAILURE_GRACE_S = 3.0  # how long a job whose rank failed may take to end before gpucomm-run stops it
ENDS_WAIT_S = 1.0  # after the launcher exited, how long the ranks' last reports may take to arrive
SETTLE_S = 0.5  # once every rank still running has reported its error, time for it to print it
RELEASE_WAIT_S = 2.0  # how long the launcher may take to exit once every rank has ended or been released
# PLACEMENT_VARS: variables that place one rank (gpucomm-run's own spawning sets them): under MPI the
# launcher's variables do, and a stale GPUCOMM_RANK would take precedence in gpucomm.bootstrap.world.
# What Open MPI forwards to every rank besides GPUCOMM_*/HOROVOD_* and the tunables, when set.
FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "VIRTUAL_ENV",
             "MPI4PY_MPIABI", "MPI4PY_LIBMPI", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
FORWARDED_PREFIXES = ("GPUCOMM_", "HOROVOD_", "NCCL_", "MPI4PY_", "TORCH_", "UCX_", "FI_", "MPIR_CVAR_")


@dataclass(frozen=True)
class MpiLauncher:
    """An MPI launcher found on this host."""

    path: str
    flavor: str  # "mpich" (Hydra's mpiexec; Intel MPI's too) or "openmpi"
    version: str  # the first line of its --version
    major: int = 0  # Open MPI's major version


def identify(path: str, timeout: float = 30.0) -> MpiLauncher | None:
    """What kind of MPI launcher ``path`` is, from its ``--version`` (None: neither MPICH nor Open MPI)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout + out.stderr
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if "Open MPI" in text or "OpenRTE" in text:
        m = re.search(r"\(Open MPI\)\s+(\d+)", text) or re.search(r"Open MPI v?(\d+)", text)
        return MpiLauncher(path, "openmpi", first, int(m.group(1)) if m else 0)
    if "HYDRA" in text or "Intel(R) MPI" in text:
        version = next((line for line in lines if line.startswith("Version:")), first)
        return MpiLauncher(path, "mpich", "Hydra " + " ".join(version.split()))
    return None


def find_launcher(env: Mapping[str, str], python: str = sys.executable) -> MpiLauncher:
    """The MPI launcher to use (see the module's docstring); ``MpiLaunchError`` says how to get one."""
    chosen = (MPIEXEC.read(env) or "").strip()
    if chosen:
        path = shutil.which(chosen, path=env.get("PATH")) or chosen
        found = identify(path)
        if found is None:
            raise MpiLaunchError(f"{LAUNCHER_VAR}={chosen!r} is not an MPI launcher gpucomm knows (MPICH's mpiexec or "
                                 f"Open MPI's mpirun; its --version names neither). Point it at one, or unset it.")
        return found
    candidates = [str(Path(python).parent / "mpiexec")]
    candidates += [p for p in (shutil.which(n, path=env.get("PATH")) for n in ("mpiexec", "mpirun")) if p]
    tried = []
    for path in dict.fromkeys(candidates):
        if not os.access(path, os.X_OK):
            continue
        found = identify(path)
        if found is not None:
            return found
        tried.append(path)
    also = f" ({', '.join(tried)} answered --version as neither MPICH nor Open MPI)" if tried else ""
    raise MpiLaunchError(f"no MPI launcher found{also}: looked for mpiexec beside {python} and for mpiexec or mpirun "
                         f"on PATH. Install one: pip install \"gpucomm[mpi]\" (mpi4py and MPICH from PyPI, no system "
                         f"MPI needed) or apt-get install openmpi-bin; or name it with {LAUNCHER_VAR}=/path/to/mpiexec.")


def host_list(rank_hosts: Sequence[str]) -> str:
    """Each rank's host (in rank order) as ``host:count,...`` (the form both launchers accept)."""
    counts: dict[str, int] = {}
    for host in rank_hosts:
        counts[host] = counts.get(host, 0) + 1
    for host in counts:
        if "@" in host:
            raise MpiLaunchError(f"host {host!r}: MPI launchers take no user@host; set the user in ~/.ssh/config "
                                 f"(Host/User) and name the host alone.")
        if is_ipv6(host):  # Open MPI reads host:slots up to the first ':' ("illegal character ... node: [")
            raise MpiLaunchError(f"host {host!r}: MPI launchers take no IPv6 address in a host list; name the host "
                                 f"by a name that resolves to it (/etc/hosts, DNS AAAA record).")
    return ",".join(f"{h}:{n}" for h, n in counts.items())


def forwarded_names(env: Mapping[str, str]) -> list[str]:
    """The variables Open MPI must copy to every rank (``-x NAME``; values stay in the environment)."""
    return sorted(k for k in env if k in FORWARDED or k.startswith(FORWARDED_PREFIXES))


def launcher_argv(launcher: MpiLauncher, rank_hosts: Sequence[str], command: Sequence[str], env: Mapping[str, str],
                  *, nic: str | None = None, local_only: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The launcher's command line for ``command`` with rank ``r`` on ``rank_hosts[r]``; ``env`` is
    the ranks' environment (Open MPI forwards its variables by name, Hydra all of them). ``nic``: the
    interface MPI's sockets are to use (``binding_interface``); ``local_only``: every rank on this
    host, so Open MPI needs no TCP transport at all. Options the user set (``OMPI_MCA_*`` in ``env``,
    or in ``extra``) are left to the user."""
    hosts, np = host_list(rank_hosts), str(len(rank_hosts))
    if launcher.flavor == "mpich":
        argv = [launcher.path, "-n", np, "-hosts", hosts]  # Hydra forwards the whole environment itself
        if nic and "-iface" not in extra:
            argv += ["-iface", nic]  # the address its proxies connect to (its listener stays on 0.0.0.0)
    else:
        argv = [launcher.path, "-np", np, "-H", hosts, "--bind-to", "none", "--map-by", "slot"]
        for name in forwarded_names(env):
            argv += ["-x", name]
        for name, value in openmpi_binding(nic, local_only=local_only):
            if f"OMPI_MCA_{name}" not in env and name not in extra:
                argv += ["--mca", name, value]
    return argv + list(extra) + list(command)


# Open MPI's network transports (4.x and 5.x names); what is left on one host is shared memory and self
NETWORK_BTLS = "^tcp,ofi,uct,usnic,openib"


def openmpi_binding(nic: str | None, *, local_only: bool) -> list[tuple[str, str]]:
    """Open MPI's MCA parameters for ``nic``: its runtime (oob) and its TCP transport (btl) publish
    and connect over that interface only (their listeners still bind every interface: Open MPI has
    no option for it, measured on 4.1.4); on one host every network transport is left out (TCP, and
    libfabric's ``ofi``, whose provider listened on eth0 despite ``FI_TCP_IFACE=lo``), so the ranks
    listen on nothing of Open MPI's (shared memory carries the data)."""
    params = []
    if nic:
        params += [("oob_tcp_if_include", nic), ("btl_tcp_if_include", nic)]
    if local_only:
        params.append(("btl", NETWORK_BTLS))
    return params


def binding_interface(rank_hosts: Sequence[str], nic: str | None) -> str | None:
    """The interface MPI's own sockets are to use: ``--network-interface``'s, else loopback when
    every rank runs on this host; None (MPI's own choice) for several hosts without one."""
    if nic:
        return nic
    return loopback_interface() if all(is_local(h) for h in rank_hosts) else None


def loopback_interface() -> str:
    """The name of this host's loopback interface (``lo`` on Linux)."""
    import psutil  # noqa: PLC0415 - as netaddr does: only when asked

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def binding_environment(nic: str | None, *, local_only: bool, env: Mapping[str, str]) -> dict[str, str]:
    """The MPI libraries' variables that bind their data sockets to ``nic`` (only those ``env`` does
    not set already). MPICH over libfabric: ``FI_TCP_IFACE``/``FI_SOCKETS_IFACE``; MPICH's ch3
    builds: ``MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE``; UCX (MPICH's ch4:ucx, Open MPI's pml ucx):
    ``UCX_NET_DEVICES``, on one host only, because it also selects the RDMA devices a multi-host job
    needs."""
    if not nic:
        return {}
    wanted = {"FI_TCP_IFACE": nic, "FI_SOCKETS_IFACE": nic, "MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE": nic}
    if local_only:
        wanted["UCX_NET_DEVICES"] = nic
    return {k: v for k, v in wanted.items() if k not in env}


def rank_environment(base: Mapping[str, str], tunables: Mapping[str, str], launcher: MpiLauncher, *,
                     rendezvous_addr: str, rendezvous_port: int, secret: bytes, run_id: str) -> dict[str, str]:
    """The environment the MPI launcher starts the ranks with: the launcher's, less stale placement
    variables, plus the tunables and the job's store, secret and run id."""
    env = {k: v for k, v in base.items() if k not in PLACEMENT_VARS}
    env.update(tunables)
    env.update(rendezvous_env(rendezvous_addr, rendezvous_port, secret, run_id))
    if launcher.flavor == "openmpi":
        if "MPI4PY_MPIABI" not in env and "MPI4PY_LIBMPI" not in env:
            env["MPI4PY_MPIABI"] = "openmpi"  # not the MPICH library a gpucomm[mpi] install also brings
        if os.geteuid() == 0:  # containers often run as root; Open MPI refuses that unless told
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _pass_through(pipe: IO[bytes], target: IO[str]) -> threading.Thread:
    """The MPI launcher's own messages, as they are."""
    def copy() -> None:
        try:
            for raw in iter(pipe.readline, b""):
                target.write(raw.decode("utf-8", errors="replace"))
                target.flush()
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    t = threading.Thread(target=copy, name="mpiexec-output", daemon=True)
    t.start()
    return t


@dataclass
class MpiJobEnd:
    """How a job started through MPI ended: gpucomm-run's exit status, the rank blamed (None when
    none failed, or a signal to gpucomm-run stopped it), each rank's last stderr lines, and what
    ``collect(server, run_id)`` read from the store before it closed."""

    code: int
    blamed: Blame | None
    stderr_tails: dict[int, list[str]]
    collected: Any = None


def run_mpi_job(rank_hosts: Sequence[str], command: Sequence[str], env: Mapping[str, str], tunables: Mapping[str, str],
                *, store_addr: str, grace: float, output_dir: str | None = None, timestamps: bool = False,
                verbose: bool = False, nic: str | None = None, mpi_args: str = "", python: str = sys.executable,
                publish: Callable[[RendezvousServer, str], None] | None = None,
                collect: Callable[[RendezvousServer, str], Any] | None = None) -> MpiJobEnd:
    """Serve the store and the rank channel, start ``command`` (rank ``r`` on ``rank_hosts[r]``)
    through the MPI launcher behind ``mpi_rank.py`` (run by ``python``), and return how it ended. Its
    ``code``: 0, or the first failed rank's (128+N for a rank killed by signal N, as gpucomm-run's own
    launcher gives), or 128+N after signal N to gpucomm-run, which stops the launcher and every rank
    (SIGTERM, then SIGKILL after ``grace``). ``publish(server, run_id)`` runs before the launcher
    starts (``gpucomm.run`` puts its function there); ``collect`` after every rank has ended."""
    launcher = find_launcher(env)
    if launcher.flavor == "mpich" and is_ipv6(store_addr):
        raise MpiLaunchError(
            f"the hosts reach this one over IPv6 only (this host is {store_addr} to them), "
            f"and MPICH's Hydra launcher ({launcher.path}) is IPv4 only: its proxies on the other hosts look up "
            f"this host's name for an IPv4 address and stop ('unable to get host address'). Fix: launch through "
            f"Open MPI's mpirun (GPUCOMM_MPIEXEC=/path/to/mpirun), or without --mpi (gpucomm-run's own launcher "
            f"and Gloo take IPv6), or give the hosts IPv4 addresses.")
    size = len(rank_hosts)
    iface = binding_interface(rank_hosts, nic)
    secret, run_id = secrets.token_bytes(32), secrets.token_hex(8)
    sink = OutputSink(size, output_dir, timestamps=timestamps)
    stop: list[int] = []
    with RendezvousServer(secret, store_addr, 0) as server:
        if publish is not None:
            publish(server, run_id)
        output = OutputServer(sink, store_addr, secret, run_id, size, on_end=_announcer(sink, size))
        rank_env = rank_environment(env, tunables, launcher, rendezvous_addr=store_addr, rendezvous_port=server.port,
                                    secret=secret, run_id=run_id)
        rank_env.update({"GPUCOMM_OUTPUT_ADDR": store_addr, "GPUCOMM_OUTPUT_PORT": str(output.port)})
        argv = _bound_launch(launcher, rank_hosts, [python, str(Path(__file__).with_name("mpi_rank.py")), *command],
                             rank_env, iface, shlex.split(mpi_args))
        if verbose:
            sink.say(f"job {run_id}: {size} rank(s) through {launcher.flavor} ({launcher.version}); rendezvous "
                     f"store at {host_port(store_addr, server.port)}; MPI's sockets on {iface or 'the interfaces MPI picks'}")
            sink.say("launcher command: " + shlex.join(argv))
        proctree.become_subreaper()
        previous = proctree.install_stop_handlers(lambda signum, _frame: stop.append(signum))
        try:
            try:
                proc = subprocess.Popen(argv, env=rank_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=proctree.die_with_parent_hook())
            except OSError as e:
                sink.say(f"cannot start the MPI launcher {launcher.path}: {e.strerror or e}")
                return MpiJobEnd(127, None, {})
            own = [_pass_through(proc.stdout, sys.stdout), _pass_through(proc.stderr, sys.stderr)]
            overdue = _watch(proc, stop, output.ends, lambda: read_failures(server.snapshot(), run_id))
            output.ends.release()
            if stop:
                sink.say(f"received {signal.Signals(stop[0]).name}; stopping the MPI launcher and every rank.")
            elif overdue:
                sink.say(f"a rank failed and the job did not end within {FAILURE_GRACE_S:g} s; stopping the MPI "
                         f"launcher and every rank (SIGTERM, then SIGKILL after {grace:g} s).")
            _wait_briefly(proc, 0.0 if stop else RELEASE_WAIT_S)
            proctree.terminate_trees([proc.pid], grace, sweep=(os.getpid(),))  # leftovers too, after a normal end
            code = proc.wait()
            output.ends.wait_all(ENDS_WAIT_S)  # the wrappers' last reports may still be on their way
            for t in own + output.pumps:
                t.join(timeout=5)
        finally:
            proctree.restore_handlers(previous)
            output.close()
        collected = collect(server, run_id) if collect is not None else None
        if stop:
            return MpiJobEnd(128 + stop[0], None, dict(sink.stderr_tails), collected)
        found = blame(output.ends.ends(), read_failures(server.snapshot(), run_id))
        return MpiJobEnd(_outcome(sink, found, 128 - code if code < 0 else code, launcher), found,
                         {rank: list(tail) for rank, tail in sink.stderr_tails.items()}, collected)


def _bound_launch(launcher: MpiLauncher, rank_hosts: Sequence[str], wrapped: list[str], rank_env: dict[str, str],
                  iface: str | None, extra: list[str]) -> list[str]:
    """The launcher's command line for the wrapped command, with MPI told to use ``iface`` (its
    variables are added to ``rank_env``)."""
    local_only = all(is_local(h) for h in rank_hosts)
    rank_env.update(binding_environment(iface, local_only=local_only, env=rank_env))
    return launcher_argv(launcher, rank_hosts, wrapped, rank_env, nic=iface, local_only=local_only, extra=extra)


def _outcome(sink: OutputSink, found: Blame | None, launcher_code: int, launcher: MpiLauncher) -> int:
    """Report the failed rank (or the launcher's own failure) and return gpucomm-run's exit status."""
    if found is None:
        if launcher_code != 0:
            _report_launcher(sink, launcher_code, launcher)
        return launcher_code
    sink.say("\n".join(found.lines + _stderr_tail(sink, found.rank)
                       + [f"job failed: rank {found.rank} on {found.host} {found.how}; gpucomm-run exits with "
                          f"{found.code}."]))
    return found.code


def _announcer(sink: OutputSink, size: int) -> Callable[[RankEnd], None]:
    """Say at once when the first rank fails (its wrapper's report), as gpucomm-run's own launcher does."""
    said: list[int] = []

    def announce(end: RankEnd) -> None:
        if end.failed and end.reported and not end.after_release and not said:
            said.append(end.rank)
            sink.say(f"rank {end.rank} on {end.host} {end.describe()}; the other {size - 1} rank(s) get up to "
                     f"{FAILURE_GRACE_S:g} s to end by themselves (gpucomm's control plane tells them which rank "
                     f"failed), then gpucomm-run stops them.")
    return announce


def _watch(proc: subprocess.Popen, stop: list[int], ends: RankEnds, failures: Callable[[], list]) -> bool:
    """Wait for the launcher to exit or a signal to arrive. Once a rank has failed (its wrapper's
    report, or a failure report in the store), the failed rank's wrapper holds MPI's launcher back
    (it would kill the other ranks at once) so that gpucomm's control plane can tell them which rank
    failed. The held wrappers are released when every rank has ended or reported its own error
    (and ``SETTLE_S`` has passed for that error to be printed), or after ``FAILURE_GRACE_S``.
    Returns True when the grace ran out first (the job is then stopped)."""
    failed_at = settled_at = None
    while proc.poll() is None and not stop:
        time.sleep(0.05)
        now = time.monotonic()
        reported = {f.rank for f in failures()}
        if failed_at is None and (reported or ends.first_failure() is not None):
            failed_at = now
        if failed_at is None:
            continue
        if ends.all_ended():
            return False
        if settled_at is None and all(r in reported for r in ends.running()):
            settled_at = now
        if settled_at is not None and now - settled_at >= SETTLE_S:
            return False
        if now - failed_at > FAILURE_GRACE_S:
            return True
    return False


def _wait_briefly(proc: subprocess.Popen, seconds: float) -> None:
    """Give the launcher ``seconds`` to exit by itself (its ranks have ended, or been released)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


@dataclass(frozen=True)
class Blame:
    """The rank a failed job is blamed on, with the report's lines and gpucomm-run's exit status."""

    rank: int
    host: str
    how: str
    code: int
    lines: list[str]


def blame(ends: Sequence[RankEnd], reported: Sequence[Failure]) -> Blame | None:
    """Which rank failed first, as gpucomm-run's own launcher decides: a rank killed by a signal that
    reported nothing itself is the cause, and the errors the others reported (a peer lost, a collective
    broken) are its echoes; otherwise the first failure reported through the store; otherwise the first
    rank that ended abnormally. Ends learned after gpucomm-run began to end the job are never the
    cause. None when no rank failed."""
    causes = [e for e in ends if not e.after_release]
    first = next((e for e in causes if e.failed and e.reported), None)
    if first is not None and first.signal is not None and not any(f.rank == first.rank for f in reported):
        return Blame(first.rank, first.host, f"{first.describe()} (the first rank to fail)", first.exit_status, [])
    if reported:
        root = reported[0]
        own = next((e for e in causes if e.rank == root.rank and e.failed and e.reported), None)
        code = own.exit_status if own is not None else 1
        return Blame(root.rank, root.host, f"raised the job's first error ({root.error})", code,
                     [f"rank {root.rank} on {root.host} failed first: {root.error}"])
    if first is None:
        first = next((e for e in causes if not e.reported), None)
        if first is None:
            return None
    return Blame(first.rank, first.host, f"{first.describe()} (the first rank to fail)", first.exit_status, [])


def _stderr_tail(out: OutputSink, rank: int) -> list[str]:
    tail = list(out.stderr_tails.get(rank, ()))
    return ([f"last {len(tail)} line(s) of rank {rank}'s stderr:"] + [f"  | {t}" for t in tail]) if tail else []


def _report_launcher(out: OutputSink, code: int, launcher: MpiLauncher) -> None:
    """No rank reported a failure, yet the launcher failed (it could not start them, or lost a host)."""
    out.say(f"job failed: the MPI launcher ({launcher.path}) exited with {code} and no rank reported a failure "
            f"(it may not have started them; its own messages above say why); gpucomm-run exits with {code}.")


__all__ = ["Blame", "FORWARDED", "LAUNCHER_VAR", "MpiJobEnd", "MpiLaunchError", "MpiLauncher", "OutputServer", "PLACEMENT_VARS",
           "binding_environment", "binding_interface", "blame", "find_launcher", "forwarded_names", "host_list",
           "identify", "launcher_argv", "loopback_interface", "openmpi_binding", "rank_environment", "run_mpi_job"]
