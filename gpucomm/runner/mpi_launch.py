"""``gpucomm-run --mpi``: start the ranks through an MPI launcher (MPICH's ``mpiexec`` or Open MPI's
``mpirun``) instead of gpucomm-run's own spawning, so that MPI's data plane can carry the job's CPU
collectives (``gpucomm/backends/mpi.py``).

gpucomm-run still serves the job's rendezvous store with a fresh secret and exports the job's
variables (``GPUCOMM_RENDEZVOUS_*``, ``GPUCOMM_SECRET``, the tunables); each rank's place comes from
the MPI launcher's own variables (``PMI_*`` or ``OMPI_COMM_WORLD_*``), which
``gpucomm.bootstrap.world`` reads. Each rank starts as ``mpi_rank.py COMMAND``, which sends its
stdout and stderr to gpucomm-run and execs the command, so output lines carry gpucomm-run's
``[rank]<stdout>:`` prefixes as always. The secret travels only in the environment (Open MPI's
``-x NAME`` copies it by name), never on a command line.

Which launcher: ``GPUCOMM_MPIEXEC`` if set, else the ``mpiexec`` beside this Python (``pip install
"gpucomm[mpi]"`` puts MPICH's there, matching the library mpi4py loads), else ``mpiexec`` or
``mpirun`` on ``PATH``; its ``--version`` says whether it is MPICH (Hydra) or Open MPI.
"""

from __future__ import annotations

import hmac
import json
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

from ..bootstrap.rendezvous import RendezvousServer
from ..errors import MpiLaunchError
from ..failures import read_failures
from . import proctree
from .mpi_rank import hello
from .output import OutputSink

LAUNCHER_VAR = "GPUCOMM_MPIEXEC"
HELLO_TIMEOUT_S = 30.0  # a rank's output connection must say who it is within this
HELLO_MAX_BYTES = 4096
FAILURE_POLL_S = 0.5  # how often gpucomm-run reads the ranks' failure reports from its store
FAILURE_GRACE_S = 3.0  # how long a job whose rank failed may take to end before gpucomm-run stops it
# Variables that place one rank (gpucomm-run's own spawning sets them): under MPI the launcher's
# variables do, and a stale GPUCOMM_RANK would take precedence in gpucomm.bootstrap.world.
PLACEMENT_VARS = tuple(f"{p}_{v}" for p in ("GPUCOMM", "HOROVOD") for v in
                       ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"))
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
    chosen = env.get(LAUNCHER_VAR, "").strip()
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
    return ",".join(f"{h}:{n}" for h, n in counts.items())


def forwarded_names(env: Mapping[str, str]) -> list[str]:
    """The variables Open MPI must copy to every rank (``-x NAME``; values stay in the environment)."""
    return sorted(k for k in env if k in FORWARDED or k.startswith(FORWARDED_PREFIXES))


def launcher_argv(launcher: MpiLauncher, rank_hosts: Sequence[str], command: Sequence[str], env: Mapping[str, str],
                  *, nic: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The launcher's command line for ``command`` with rank ``r`` on ``rank_hosts[r]``; ``env`` is
    the ranks' environment (Open MPI forwards its variables by name, Hydra all of them)."""
    hosts, np = host_list(rank_hosts), str(len(rank_hosts))
    if launcher.flavor == "mpich":
        argv = [launcher.path, "-n", np, "-hosts", hosts]  # Hydra forwards the whole environment itself
        if nic:
            argv += ["-iface", nic]
    else:
        argv = [launcher.path, "-np", np, "-H", hosts, "--bind-to", "none", "--map-by", "slot"]
        for name in forwarded_names(env):
            argv += ["-x", name]
        if nic:
            argv += ["--mca", "btl_tcp_if_include", nic, "--mca", "oob_tcp_if_include", nic]
    return argv + list(extra) + list(command)


def rank_environment(base: Mapping[str, str], tunables: Mapping[str, str], launcher: MpiLauncher, *,
                     rendezvous_addr: str, rendezvous_port: int, secret: bytes, run_id: str) -> dict[str, str]:
    """The environment the MPI launcher starts the ranks with: the launcher's, less stale placement
    variables, plus the tunables and the job's store, secret and run id."""
    env = {k: v for k, v in base.items() if k not in PLACEMENT_VARS}
    env.update(tunables)
    env.update({"GPUCOMM_RENDEZVOUS_ADDR": rendezvous_addr, "GPUCOMM_RENDEZVOUS_PORT": str(rendezvous_port),
                "GPUCOMM_RENDEZVOUS_HOSTED": "1", "GPUCOMM_SECRET": secret.hex(), "GPUCOMM_RUN_ID": run_id,
                "PYTHONUNBUFFERED": "1"})
    if launcher.flavor == "openmpi":
        if "MPI4PY_MPIABI" not in env and "MPI4PY_LIBMPI" not in env:
            env["MPI4PY_MPIABI"] = "openmpi"  # not the MPICH library a gpucomm[mpi] install also brings
        if os.geteuid() == 0:  # containers often run as root; Open MPI refuses that unless told
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


class OutputServer:
    """Accepts each rank's stdout and stderr connections (``mpi_rank.py`` opens them before it
    execs the command) and copies their lines to ``sink`` with the rank's prefix. A connection
    whose first line does not carry the job's HMAC is dropped."""

    def __init__(self, sink: OutputSink, addr: str, secret: bytes, run_id: str, size: int) -> None:
        self._sink, self._secret, self._run_id, self._size = sink, secret, run_id, size
        self._listener = socket.create_server((addr, 0))
        self.port = self._listener.getsockname()[1]
        self.pumps: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, name="mpi-output", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(conn,), name="mpi-output-hello", daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            reader = conn.makefile("rb")
            line = reader.readline(HELLO_MAX_BYTES)
            conn.settimeout(None)
            msg = json.loads(line)
            rank, stream = int(msg["rank"]), str(msg["stream"])
            expected = hello(self._secret, self._run_id, rank, stream)
            if not (0 <= rank < self._size and stream in ("stdout", "stderr")
                    and hmac.compare_digest(line, expected)):
                raise ValueError("bad hello")
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        self.pumps.append(self._sink.pump(rank, stream, reader))

    def close(self) -> None:
        self._listener.close()


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


def run_mpi_job(rank_hosts: Sequence[str], command: Sequence[str], env: Mapping[str, str], tunables: Mapping[str, str],
                *, store_addr: str, grace: float, output_dir: str | None = None, timestamps: bool = False,
                verbose: bool = False, nic: str | None = None, mpi_args: str = "", python: str = sys.executable) -> int:
    """Serve the store and the ranks' output, start ``command`` (rank ``r`` on ``rank_hosts[r]``)
    through the MPI launcher behind ``mpi_rank.py`` (run by ``python``), and return the job's exit
    status (the launcher's; 128+N after signal N to gpucomm-run, which stops the launcher and
    every rank: SIGTERM, then SIGKILL after ``grace``)."""
    launcher = find_launcher(env)
    size = len(rank_hosts)
    secret, run_id = secrets.token_bytes(32), secrets.token_hex(8)
    sink = OutputSink(size, output_dir, timestamps=timestamps)
    stop: list[int] = []
    with RendezvousServer(secret, store_addr, 0) as server:
        output = OutputServer(sink, store_addr, secret, run_id, size)
        rank_env = rank_environment(env, tunables, launcher, rendezvous_addr=store_addr, rendezvous_port=server.port,
                                    secret=secret, run_id=run_id)
        rank_env.update({"GPUCOMM_OUTPUT_ADDR": store_addr, "GPUCOMM_OUTPUT_PORT": str(output.port)})
        wrapped = [python, str(Path(__file__).with_name("mpi_rank.py")), *command]
        argv = launcher_argv(launcher, rank_hosts, wrapped, rank_env, nic=nic, extra=shlex.split(mpi_args))
        if verbose:
            sink.say(f"job {run_id}: {size} rank(s) through {launcher.flavor} ({launcher.version}); rendezvous "
                     f"store at {store_addr}:{server.port}")
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
                return 127
            own = [_pass_through(proc.stdout, sys.stdout), _pass_through(proc.stderr, sys.stderr)]
            failed = _watch(proc, stop, lambda: read_failures(server.snapshot(), run_id))
            if stop:
                sink.say(f"received {signal.Signals(stop[0]).name}; stopping the MPI launcher and every rank.")
            elif failed is not None:
                sink.say(f"rank {failed.rank} failed and the job did not end within {FAILURE_GRACE_S:g} s; stopping "
                         f"the MPI launcher and every rank (SIGTERM, then SIGKILL after {grace:g} s).")
            proctree.terminate_trees([proc.pid], grace, sweep=(os.getpid(),))  # leftovers too, after a normal end
            code = proc.wait()
            for t in own + output.pumps:
                t.join(timeout=5)
        finally:
            proctree.restore_handlers(previous)
            output.close()
        if stop:
            return 128 + stop[0]
        code = 128 - code if code < 0 else code
        if failed is not None and code in (0, 128 + signal.SIGTERM, 128 + signal.SIGKILL):
            code = 1  # stopped by us: the rank's failure, not our signal, is the job's outcome
        if code != 0:
            _report(sink, code, read_failures(server.snapshot(), run_id), launcher)
        return code


def _watch(proc: subprocess.Popen, stop: list[int], failures: Callable[[], list]) -> Any:
    """Wait for the launcher to exit or a signal to arrive; after a rank's failure is reported
    through the store, give the job ``FAILURE_GRACE_S`` to end by itself (MPICH's launcher waits
    for every rank even when one exits with an error). Returns that failure, or None."""
    next_check, failed, failed_at = 0.0, None, 0.0
    while proc.poll() is None and not stop:
        time.sleep(0.05)
        now = time.monotonic()
        if failed is None and now >= next_check:
            next_check = now + FAILURE_POLL_S
            reported = failures()
            if reported:
                failed, failed_at = reported[0], now
        if failed is not None and now - failed_at > FAILURE_GRACE_S:
            return failed
    return None


def _report(out: OutputSink, code: int, failures: list, launcher: MpiLauncher) -> None:
    """Name the first rank that failed (reported through the store) and show its stderr's end."""
    lines = []
    rank = None
    if failures:
        first = failures[0]
        rank = first.rank
        lines.append(f"rank {first.rank} on {first.host} failed first: {first.error}")
    else:
        failed = [r for r, tail in sorted(out.stderr_tails.items()) if any("Error" in t or "Traceback" in t for t in tail)]
        rank = failed[0] if failed else None
    if rank is not None and out.stderr_tails.get(rank):
        tail = list(out.stderr_tails[rank])
        lines.append(f"last {len(tail)} line(s) of rank {rank}'s stderr:")
        lines += [f"  | {t}" for t in tail]
    lines.append(f"job failed: the MPI launcher ({launcher.path}) exited with {code}; gpucomm-run exits with {code}.")
    out.say("\n".join(lines))


__all__ = ["FORWARDED", "LAUNCHER_VAR", "MpiLaunchError", "MpiLauncher", "OutputServer", "PLACEMENT_VARS",
           "find_launcher", "forwarded_names", "host_list", "identify", "launcher_argv", "rank_environment",
           "run_mpi_job"]
