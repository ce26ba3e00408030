"""``gpucomm-run``'s command line: its flags (Horovod's ``horovodrun`` flags, the ones it refuses,
and the ones accepted without effect) and their checks. ``cli.py`` runs what they ask for.
"""

from __future__ import annotations

import argparse
import math
import sys

from .. import __version__
from ..settings import MAX_SECONDS

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


__all__ = ["DEFAULT_GRACE", "DEFAULT_START_TIMEOUT", "build_parser"]
