"""``gpucomm-run``: start an N-rank job on this host or several, as ``horovodrun`` does.

    gpucomm-run -np 4 -H host1:2,host2:2 python train.py

The launcher serves the job's authenticated rendezvous store itself, makes a fresh random secret
per run, exports each rank's place (``GPUCOMM_*`` and ``HOROVOD_*``), prefixes every output line
with the rank, and stops the whole job when any rank fails.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shlex
import sys
from typing import Any, Callable, Mapping, Sequence

from .. import __version__
from ..failures import read_failures
from ..bootstrap.netaddr import address_towards, interface_ipv4
from ..bootstrap.rendezvous import RendezvousServer
from ..settings import GLOO_IFACE, MAX_SECONDS, START_TIMEOUT, SettingError, liveness_seconds, settings_problems
from .check_build import check_build_report
from .discovery import DiscoveryScript, FixedHosts
from .elastic_driver import ElasticDriver, make_limits
from .hosts import HostSlots, HostSpecError, assign_slots, parse_hostfile, parse_hosts
from .mpi_launch import MpiJobEnd, run_mpi_job
from .output import OutputSink
from .spawn import SshOptions, build_launches, is_local, split_user
from .supervisor import Supervisor

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_GRACE = 10.0


def _number(kind: type, *, allow_zero: bool, maximum: float | None = None):
    """An argparse type: a finite ``kind`` above 0 (or from 0), at most ``maximum``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'non-negative' if allow_zero else 'positive'}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {maximum:g}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _positive(kind: type):
    return _number(kind, allow_zero=False)


def _non_negative(kind: type):
    return _number(kind, allow_zero=True)


def _seconds(*, allow_zero: bool = False, scale: float = 1.0):
    """A duration flag: finite, at most what the ranks accept (``MAX_SECONDS``, times ``scale`` for ms)."""
    return _number(float, allow_zero=allow_zero, maximum=MAX_SECONDS * scale)


_REFUSED_FLAGS = {
    "--hierarchical-allreduce": "gpucomm has no hierarchical allreduce; NCCL chooses ring or tree across nodes by "
                                "itself, so leave the flag out",
    "--hierarchical-allgather": "gpucomm has no hierarchical allgather; leave the flag out",
    "--torus-allreduce": "gpucomm has no torus allreduce; NCCL chooses ring or tree across nodes by itself, so leave "
                         "the flag out",
    "--mpi-threads-disable": "gpucomm's CPU collectives on MPI need MPI_THREAD_MULTIPLE (they run on the job's "
                             "background thread); leave the flag out",
    "--jsrun": "gpucomm-run does not start ranks through IBM's jsrun; give the hosts with -H/--hostfile (ssh), or use "
               "--mpi for an MPI launcher",
    "--config-file": "gpucomm-run reads no config file; give its settings as flags, or as GPUCOMM_*/HOROVOD_* "
                     "variables in the environment",
}

# horovodrun flags asking for what gpucomm always does, or tuning a part gpucomm does not have: accepted, and
# said once at start (never silently ignored)
_NO_EFFECT_FLAGS = {
    "--no-hierarchical-allreduce": (False, "gpucomm's allreduce is never hierarchical"),
    "--no-hierarchical-allgather": (False, "gpucomm's allgather is never hierarchical"),
    "--no-torus-allreduce": (False, "gpucomm has no torus allreduce"),
    "--no-mpi-threads-disable": (False, "gpucomm always asks MPI for MPI_THREAD_MULTIPLE"),
    "--num-nccl-streams": (True, "gpucomm issues a GPU's NCCL collectives on one stream, in one order agreed by "
                                 "every rank"),
    "--thread-affinity": (True, "gpucomm's background threads follow the rank's own CPU affinity (--cpu-affinity "
                                "binds a rank to its GPU's CPUs)"),
}


class _NoEffect(argparse.Action):
    """A horovodrun flag that changes nothing here: accepted, and why printed once."""

    def __init__(self, *args, why: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"gpucomm-run: {option_string}: accepted, no effect: {self.why}.", file=sys.stderr)


class _Refused(argparse.Action):
    """A horovodrun flag gpucomm does not offer: exit with what to do instead (not 'unrecognized')."""

    def __init__(self, *args, advice: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.advice = advice

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"gpucomm-run: {option_string}: {self.advice}.\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucomm-run", description="Launch a gpucomm (Horovod-style) data-parallel job.", allow_abbrev=False,
        epilog="Example: gpucomm-run -np 4 -H node1:2,node2:2 python train.py")
    p.add_argument("--version", action="version", version=f"gpucomm-run {__version__}")
    p.add_argument("-np", "--num-proc", type=_positive(int), dest="np", help="number of ranks to start")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="hosts and slots, e.g. node1:2,node2:2 (default: localhost:<np>); a "
                                             "host written user@host is always reached through ssh")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("-p", "--ssh-port", type=_positive(int), help="ssh port on the remote hosts")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    p.add_argument("--ssh-args", default="",
                   help="more ssh arguments, one string, e.g. \"-J gateway -o UserKnownHostsFile=~/.ssh/cluster_hosts\"")
    p.add_argument("--remote-python", default=sys.executable,
                   help="Python on the remote hosts that has gpucomm installed (default: this launcher's, %(default)s)")
    p.add_argument("--network-interface", "--network-interfaces", dest="nics", action="append",
                   help="network interface(s) for NCCL and Gloo traffic, e.g. eth0 or ib0,eth0 (repeatable)")
    p.add_argument("--start-timeout", type=_seconds(),
                   help=f"seconds the ranks have to start and meet in init() (default {DEFAULT_START_TIMEOUT:g}, "
                        f"or GPUCOMM_START_TIMEOUT / HOROVOD_START_TIMEOUT)")
    p.add_argument("--timeout", "--gloo-timeout-seconds", dest="timeout", type=_seconds(),
                   help="seconds one collective may take before it fails on every rank (default 300, or "
                        "GPUCOMM_TIMEOUT)")
    p.add_argument("--stop-grace", type=_seconds(), default=DEFAULT_GRACE,
                   help="seconds ranks get between SIGTERM and SIGKILL when the job stops (default %(default)g)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<N>/stdout and stderr")
    p.add_argument("--verbose", action="store_true", help="print the slot plan and each rank's start and exit")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print what this installation can do (NCCL, Gloo, GPUs, Numba CUDA) and exit")
    p.add_argument("--prefix-output-with-timestamp", action="store_true",
                   help="start every output line with the time it was printed (horovodrun's flag)")
    compat = p.add_argument_group("horovodrun flags that gpucomm accepts or explains")
    compat.add_argument("--gloo", action="store_true",
                        help="accepted: gpucomm's own controller always runs the job (Gloo on CPU, NCCL on GPU)")
    compat.add_argument("--mpi", action="store_true",
                        help="start the ranks through MPI's launcher (MPICH's mpiexec from `pip install "
                             "\"gpucomm[mpi]\"`, or Open MPI's mpirun; GPUCOMM_MPIEXEC names one), so CPU "
                             "collectives can move through MPI (shared memory on one host)")
    compat.add_argument("--mpi-args", default="",
                        help="more arguments for the MPI launcher, one string, e.g. \"--mca plm_rsh_args '-p 2222'\"")
    compat.add_argument("--tcp", action="store_true", help="use TCP, not InfiniBand/RDMA, for NCCL (NCCL_IB_DISABLE=1)")
    compat.add_argument("--disable-cache", action="store_true",
                        help="turn the response cache off (GPUCOMM_CACHE_CAPACITY=0)")
    for flag, advice in _REFUSED_FLAGS.items():
        compat.add_argument(flag, action=_Refused, nargs="?", const=None, advice=advice, help=f"not offered: {advice}")
    for flag, (takes_value, why) in _NO_EFFECT_FLAGS.items():
        compat.add_argument(flag, action=_NoEffect, nargs=1 if takes_value else 0, why=why, dest=argparse.SUPPRESS,
                            metavar="N" if takes_value else None,
                            default=argparse.SUPPRESS, help=f"accepted, no effect: {why}")
    compat.add_argument("--binding-args", default="",
                        help="process binding arguments for the MPI launcher (with --mpi; added to --mpi-args), "
                             "e.g. \"--bind-to none\"")
    tune = p.add_argument_group("tunables (exported to every rank)")
    tune.add_argument("--autotune", action="store_true",
                      help="choose each DistributedOptimizer's buckets from measured costs: the step model's best "
                           "plans are tried and the fastest measured one is kept (GPUCOMM_AUTOTUNE, HOROVOD_AUTOTUNE)")
    tune.add_argument("--no-autotune", dest="autotune", action="store_false", help="the default: no autotune")
    tune.add_argument("--autotune-log-file",
                      help="write what autotune tried and measured to this CSV (rank 0; GPUCOMM_AUTOTUNE_LOG)")
    tune.add_argument("--autotune-warmup-samples", type=_non_negative(int),
                      help="autotune: untimed steps before the trial (default 3)")
    tune.add_argument("--autotune-steps-per-sample", type=_positive(int),
                      help="autotune: steps timed per plan, their median decides (default 10)")
    for flag in ("--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise"):
        tune.add_argument(flag, help="accepted for horovodrun scripts; no effect: gpucomm's autotune measures the "
                                     "step model's plans instead of a Bayesian search")
    tune.add_argument("--fusion-threshold-mb", type=_non_negative(float),
                      help="fusion buffer (bucket) cap in MiB; 0 turns fusion off (GPUCOMM_FUSION_THRESHOLD, "
                           "HOROVOD_FUSION_THRESHOLD)")
    tune.add_argument("--timeline-filename", help="write a Chrome-trace timeline to this file (rank 0)")
    tune.add_argument("--timeline-mark-cycles", action="store_true",
                      help="mark each control-plane cycle in the timeline (GPUCOMM_TIMELINE_MARK_CYCLES)")
    tune.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false",
                      help="the default: no cycle marks in the timeline")
    tune.add_argument("--cycle-time-ms", type=_seconds(allow_zero=True, scale=1000.0),
                      help="how long async requests wait to share one control round (GPUCOMM_CYCLE_TIME, default 1)")
    tune.add_argument("--cache-capacity", type=_non_negative(int),
                      help="response cache entries; 0 disables it (GPUCOMM_CACHE_CAPACITY, default 1024)")
    tune.add_argument("--stall-check-warning-time-seconds", type=_seconds(),
                      help="warn when some ranks have waited this long for others to submit an operation "
                           "(GPUCOMM_STALL_CHECK_TIME_SECONDS, default 60)")
    tune.add_argument("--stall-check-shutdown-time-seconds", type=_seconds(allow_zero=True),
                      help="turn such a stall into an error on every rank after this long "
                           "(GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS; default 0: never)")
    tune.add_argument("--no-stall-check", action="store_true", help="disable the stall inspector")
    tune.add_argument("--stall-check", dest="no_stall_check", action="store_false",
                      help="the default: the stall inspector is on")
    tune.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_timestamp", action="store_true",
                      default=None, help="start gpucomm's log lines in the ranks with the time (GPUCOMM_LOG_TIMESTAMP)")
    tune.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_timestamp", action="store_false",
                      help="the default: gpucomm's log lines carry no time")
    tune.add_argument("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"], type=str.upper,
                      help="gpucomm log level in the ranks (GPUCOMM_LOG_LEVEL)")
    tune.add_argument("--cpu-affinity", action="store_true",
                      help="bind each rank's CPU affinity to its GPU's NUMA node (GPUCOMM_CPU_AFFINITY)")
    tune.add_argument("--single-gpu-test", action="store_true",
                      help="TEST MODE: let all ranks share one GPU (one NCCL_HOSTID per rank, socket transport); "
                           "correct but slow, never for real training (GPUCOMM_SINGLE_GPU_TEST)")
    elastic = p.add_argument_group("elastic training (enabled by --host-discovery-script or --min-np)")
    elastic.add_argument("--host-discovery-script", help="command that prints the available hosts, one 'host' or "
                                                         "'host:slots' per line; polled every second")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive(int),
                         help="fewest workers training may continue with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive(int),
                         help="most workers the job grows to (default: unbounded)")
    elastic.add_argument("--slots-per-host", dest="slots_per_host", type=_positive(int),
                         help="slots of a discovered host printed without a count (default 1)")
    elastic.add_argument("--elastic-timeout", type=_seconds(),
                         help="seconds to wait for --min-np slots after a change (default 600, or "
                              "HOROVOD_ELASTIC_TIMEOUT)")
    elastic.add_argument("--reset-limit", type=_non_negative(int),
                         help="how many times the job may be re-formed before it fails (default: unlimited)")
    elastic.add_argument("--blacklist-cooldown-range", nargs=2, type=_positive(int), metavar=("MIN", "MAX"),
                         action=_Refused, advice="gpucomm blacklists a failed host for the rest of the job; drop the "
                         "flag, and let the discovery script re-list a repaired host under another name if needed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs, with its arguments")
    return p


def refused_settings(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """Why the settings the ranks would get (``env`` under the tunable flags) are refused, in one
    line naming each variable, its value and what it accepts; None when every one parses."""
    try:
        given = {**env, **_tunables(args, env)}
    except SettingError:  # the start timeout in ``env`` (read to forward it) is refused: report all of env's
        given = env
    problems = settings_problems(given)
    if not problems:
        return None
    listed = " ".join(str(p) for p in problems)
    return (listed if len(problems) == 1 else f"{len(problems)} settings are refused: {listed}") + \
        " No rank was started."


def tunables_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The tunable flags as the environment variables the ranks read (Horovod's names too).
    Raises ``SystemExit`` with one line when a setting the ranks would get is refused."""
    problem = refused_settings(args, env)
    if problem is not None:
        raise SystemExit(f"gpucomm-run: {problem}")
    return _tunables(args, env)


def _tunables(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """``tunables_env`` unchecked: may raise ``SettingError`` for the start timeout ``env`` holds."""
    out: dict[str, str] = {}
    start = args.start_timeout or START_TIMEOUT.read(env, DEFAULT_START_TIMEOUT)
    out["GPUCOMM_START_TIMEOUT"] = out["HOROVOD_START_TIMEOUT"] = f"{start:g}"
    if args.timeout:
        out["GPUCOMM_TIMEOUT"] = out["HOROVOD_GLOO_TIMEOUT_SECONDS"] = f"{args.timeout:g}"
    if args.autotune or args.autotune_log_file:
        out["GPUCOMM_AUTOTUNE"] = out["HOROVOD_AUTOTUNE"] = "1"
    if args.autotune_log_file:
        out["GPUCOMM_AUTOTUNE_LOG"] = out["HOROVOD_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    if args.autotune_warmup_samples is not None:
        out["GPUCOMM_AUTOTUNE_WARMUP_SAMPLES"] = str(args.autotune_warmup_samples)
    if args.autotune_steps_per_sample is not None:
        if args.autotune_steps_per_sample < 2:
            raise SystemExit("gpucomm-run: --autotune-steps-per-sample must be >= 2 (a median needs samples)")
        out["GPUCOMM_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.autotune_steps_per_sample)
    if args.fusion_threshold_mb is not None:
        out["GPUCOMM_FUSION_THRESHOLD"] = out["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 2**20))
    if getattr(args, "disable_cache", False):
        out["GPUCOMM_CACHE_CAPACITY"] = out["HOROVOD_CACHE_CAPACITY"] = "0"
    if getattr(args, "tcp", False):
        out["NCCL_IB_DISABLE"] = "1"
    if args.timeline_filename:
        out["GPUCOMM_TIMELINE"] = out["HOROVOD_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.timeline_mark_cycles:
        out["GPUCOMM_TIMELINE_MARK_CYCLES"] = out["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.cycle_time_ms is not None:
        out["GPUCOMM_CYCLE_TIME"] = out["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    if args.cache_capacity is not None:
        out["GPUCOMM_CACHE_CAPACITY"] = out["HOROVOD_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.stall_check_warning_time_seconds:
        out["GPUCOMM_STALL_CHECK_TIME_SECONDS"] = out["HOROVOD_STALL_CHECK_TIME_SECONDS"] = \
            f"{args.stall_check_warning_time_seconds:g}"
    if args.stall_check_shutdown_time_seconds is not None:
        out["GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS"] = out["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = \
            f"{args.stall_check_shutdown_time_seconds:g}"
    if args.no_stall_check:
        out["GPUCOMM_STALL_CHECK_DISABLE"] = out["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if args.log_level:
        out["GPUCOMM_LOG_LEVEL"] = out["HOROVOD_LOG_LEVEL"] = args.log_level
    if getattr(args, "log_timestamp", None) is not None:
        out["GPUCOMM_LOG_TIMESTAMP"] = "1" if args.log_timestamp else "0"
    elif getattr(args, "verbose", False):  # --verbose: the ranks report their set-up steps with timings
        out["GPUCOMM_LOG_LEVEL"] = out["HOROVOD_LOG_LEVEL"] = "INFO"
    if args.cpu_affinity:
        out["GPUCOMM_CPU_AFFINITY"] = "1"
    if args.single_gpu_test:
        out["GPUCOMM_SINGLE_GPU_TEST"] = "1"
    if args.nics:
        nics = [n.strip() for item in args.nics for n in item.split(",") if n.strip()]
        out["NCCL_SOCKET_IFNAME"] = ",".join(nics)
        out["GPUCOMM_GLOO_IFACE"] = out["HOROVOD_GLOO_IFACE"] = nics[0]
    return out


def omp_threads(env: dict[str, str], slots: Sequence, remote_hosts: Sequence[str]) -> int | None:
    """Threads per rank when the user left OMP_NUM_THREADS unset and every rank runs on this host:
    cores / local ranks (at least 1); None otherwise (the user's value, or other hosts' cores unknown)."""
    if env.get("OMP_NUM_THREADS", "").strip() or remote_hosts or not slots:
        return None
    return max(1, (os.cpu_count() or 1) // max(s.local_size for s in slots))


def interface_address(nic: str) -> str:
    """The IPv4 address of a local network interface, or a clear error naming the ones that exist."""
    import psutil

    addrs = psutil.net_if_addrs()
    if nic not in addrs:
        raise SystemExit(f"gpucomm-run: the network interface {nic!r} (--network-interface, or GPUCOMM_GLOO_IFACE / "
                         f"HOROVOD_GLOO_IFACE) does not exist on this host; it has "
                         f"{', '.join(sorted(addrs)) or 'none'}.")
    address = interface_ipv4(nic)
    if address is None:
        raise SystemExit(f"gpucomm-run: the network interface {nic!r} (--network-interface, or GPUCOMM_GLOO_IFACE / "
                         f"HOROVOD_GLOO_IFACE) has no IPv4 address.")
    return address


def host_list(args: argparse.Namespace) -> list[HostSlots]:
    """The hosts and slots ``-H``/``--hostfile`` name (default: ``-np`` slots on this host)."""
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    if args.hosts:
        return parse_hosts(args.hosts)
    return [HostSlots("localhost", args.np)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        sys.stdout.write(check_build_report())
        return 0
    if args.np is None:
        parser.error("-np is required (the number of ranks to start)")
    if not args.command:
        parser.error("no command given: gpucomm-run -np 2 python train.py")
    problem = refused_settings(args, dict(os.environ))  # before any rank (or the store) starts
    if problem is not None:
        parser.exit(2, f"gpucomm-run: {problem}\n")
    if args.host_discovery_script or args.min_np is not None:
        if args.mpi:
            parser.error("--mpi cannot start an elastic job: MPI's communicators cannot add or remove ranks; leave "
                         "--mpi out (elastic jobs run on Gloo)")
        return run_elastic(args, parser)
    for flag, value in (("--max-np", args.max_np), ("--slots-per-host", args.slots_per_host),
                        ("--elastic-timeout", args.elastic_timeout), ("--reset-limit", args.reset_limit)):
        if value is not None:
            parser.error(f"{flag} is an elastic option: add --host-discovery-script (or --min-np with -H) to run "
                         f"an elastic job")
    try:
        slots = assign_slots(host_list(args), args.np)
    except HostSpecError as e:
        parser.error(str(e))
    if args.mpi:
        if args.binding_args:
            args.mpi_args = f"{args.mpi_args} {args.binding_args}".strip()
        return run_through_mpi(args, parser, slots, dict(os.environ)).code
    if args.mpi_args or args.binding_args:
        parser.error(f"{'--mpi-args' if args.mpi_args else '--binding-args'} needs --mpi (they are the MPI "
                     f"launcher's arguments)")
    return run_fixed_job(args, slots, list(args.command), dict(os.environ))[0]


def chosen_nic(tunables: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """The interface the job's traffic is to use: ``--network-interface``'s first, else the
    ``GPUCOMM_GLOO_IFACE``/``HOROVOD_GLOO_IFACE`` the ranks inherit from this environment (the
    ranks bind Gloo and rank 0's control listener there, so the store belongs there too)."""
    return tunables.get("GPUCOMM_GLOO_IFACE") or GLOO_IFACE.read(env)


def store_address(args: argparse.Namespace, tunables: dict[str, str], hosts: Sequence[str],
                  env: Mapping[str, str] | None = None) -> str:
    """Where the launcher's store listens (and the ranks reach it): the chosen interface's address
    (``chosen_nic``), else this host's address towards the first remote host, else loopback."""
    remote_hosts = [h for h in hosts if not is_local(h)]
    nic = chosen_nic(tunables, os.environ if env is None else env)
    if nic:
        return interface_address(nic)
    if remote_hosts:
        return address_towards(split_user(remote_hosts[0])[1].strip("[]"))
    return "127.0.0.1"


def run_through_mpi(args: argparse.Namespace, parser: argparse.ArgumentParser, slots: list,
                    env: dict[str, str], *, publish: Callable[[RendezvousServer, str], None] | None = None,
                    collect: Callable[[RendezvousServer, str], Any] | None = None) -> MpiJobEnd:
    """``--mpi``: the job started by the MPI launcher, with the store served here (``publish`` and
    ``collect`` as in ``run_fixed_job``)."""
    for flag, given in (("-p/--ssh-port", args.ssh_port), ("-i/--ssh-identity-file", args.ssh_identity_file),
                        ("--ssh-args", args.ssh_args)):
        if given:
            parser.error(f"{flag} does not apply with --mpi: the MPI launcher reaches other hosts itself; pass its own "
                         f"options with --mpi-args (e.g. \"--mca plm_rsh_args '-p 2222'\" for Open MPI; for MPICH, "
                         f"whose -launcher-exec takes a program and not a command line, a script that runs "
                         f"`exec ssh -p 2222 \"$@\"`: \"-launcher-exec /path/to/that-script\")")
    hosts = [s.host for s in slots]
    tunables = tunables_env(args, env)
    threads = omp_threads(env, slots, [h for h in hosts if not is_local(h)])
    if threads is not None:
        tunables["OMP_NUM_THREADS"] = str(threads)
    return run_mpi_job(hosts, list(args.command), env, tunables, store_addr=store_address(args, tunables, hosts, env),
                       grace=args.stop_grace, output_dir=args.output_filename,
                       timestamps=args.prefix_output_with_timestamp, verbose=args.verbose,
                       nic=chosen_nic(tunables, env), mpi_args=args.mpi_args, python=args.remote_python or sys.executable,
                       publish=publish, collect=collect)


def run_fixed_job(args: argparse.Namespace, slots: list, command: list[str], env: dict[str, str], *,
                  publish: Callable[[RendezvousServer, str], None] | None = None,
                  collect: Callable[[RendezvousServer, str], Any] | None = None) -> tuple[int, Supervisor, Any]:
    """Start ``command`` in every slot under fail-fast supervision and wait for the job to end;
    returns the exit status, the supervisor and what ``collect(server, run_id)`` read from the
    store before it closed. ``publish(server, run_id)`` runs before any rank starts
    (``gpucomm.run`` puts its function there). Bad input raises ``SystemExit`` with the message."""
    tunables = tunables_env(args, env)
    remote_hosts = [s.host for s in slots if not is_local(s.host)]
    # the store listens only on the address the ranks are told to use (it holds the job's keys)
    addr = store_address(args, tunables, [s.host for s in slots], env)
    secret = secrets.token_bytes(32)
    run_id = secrets.token_hex(8)
    start_timeout = float(tunables["GPUCOMM_START_TIMEOUT"])
    sink = OutputSink(args.np, args.output_filename, timestamps=args.prefix_output_with_timestamp)
    threads = omp_threads(env, slots, remote_hosts)
    if threads is not None:
        tunables["OMP_NUM_THREADS"] = str(threads)
        sink.say(f"OMP_NUM_THREADS is not set: each rank gets {threads} (this host's {os.cpu_count()} cores / "
                 f"{max(s.local_size for s in slots)} local ranks), as torchrun's default of 1 would leave cores "
                 f"idle on CPU and the library default would oversubscribe them; export OMP_NUM_THREADS to choose.")
    with RendezvousServer(secret, addr, 0) as server:
        if publish is not None:
            publish(server, run_id)
        if args.verbose:
            sink.say(f"job {run_id}: {args.np} rank(s); rendezvous store at {addr}:{server.port}")
            for s in slots:
                sink.say(f"  rank {s.rank}: host {s.host} local {s.local_rank}/{s.local_size} "
                         f"cross {s.cross_rank}/{s.cross_size}" + (" (ssh)" if s.host in remote_hosts else ""))
        launches = build_launches(
            slots, command, env, tunables, rendezvous_addr=addr, rendezvous_port=server.port,
            secret=secret, run_id=run_id, cwd=os.getcwd(),
            ssh=SshOptions(args.ssh_port, args.ssh_identity_file, start_timeout, args.remote_python,
                           tuple(shlex.split(args.ssh_args))),
            grace=args.stop_grace, silence=remote_silence({**env, **tunables}))
        supervisor = Supervisor(launches, sink, grace=args.stop_grace, verbose=args.verbose,
                                reported_failures=lambda: read_failures(server.snapshot(), run_id))
        code = supervisor.run()
        return code, supervisor, collect(server, run_id) if collect is not None else None


def remote_silence(rank_env: dict[str, str]) -> float | None:
    """How long a remote rank's wrapper waits without gpucomm-run's heartbeat before it stops the
    rank: twice the ranks' liveness limit (40 s by default), so that the ranks' own control plane
    names a lost launcher host first and the wrapper only ends what is left; None with the
    liveness check off (``GPUCOMM_LIVENESS_TIMEOUT=0``)."""
    liveness = liveness_seconds(rank_env)
    return 2 * liveness if liveness else None


def run_elastic(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """An elastic job: workers on the discovered (or listed) hosts, re-formed as they come and go."""
    env = dict(os.environ)
    try:
        limits = make_limits(args.np, args.min_np, args.max_np, args.elastic_timeout, args.reset_limit, env)
        if args.host_discovery_script:
            if args.hosts or args.hostfile:
                parser.error("give either --host-discovery-script or -H/--hostfile, not both")
            discovery = DiscoveryScript(args.host_discovery_script, args.slots_per_host or 1)
        else:
            discovery = FixedHosts(tuple(host_list(args)))
    except (HostSpecError, ValueError) as e:
        parser.error(str(e))
    tunables = tunables_env(args, env)
    secret, run_id = secrets.token_bytes(32), secrets.token_hex(8)
    nic = chosen_nic(tunables, env)
    addr = interface_address(nic) if nic else "0.0.0.0"
    sink = OutputSink(1, args.output_filename, timestamps=args.prefix_output_with_timestamp)
    with RendezvousServer(secret, addr, 0) as server:
        def store_address(host: str) -> str:  # loopback here; towards the launcher from other hosts
            if nic:
                return addr
            return "127.0.0.1" if is_local(host) else address_towards(split_user(host)[1].strip("[]"))

        driver = ElasticDriver(discovery, limits, list(args.command), env, tunables, server,
                               rendezvous_addr=store_address,
                               secret=secret, run_id=run_id, sink=sink,
                               ssh=SshOptions(args.ssh_port, args.ssh_identity_file,
                                              float(tunables["GPUCOMM_START_TIMEOUT"]), args.remote_python,
                                              tuple(shlex.split(args.ssh_args))),
                               grace=args.stop_grace, verbose=args.verbose)
        return driver.run()


def console_main() -> None:
    """Entry point of the ``gpucomm-run`` console script."""
    sys.exit(main())


__all__ = ["build_parser", "chosen_nic", "console_main", "interface_address", "main", "omp_threads", "refused_settings",
           "remote_silence", "run_fixed_job", "run_through_mpi", "store_address", "tunables_env"]
