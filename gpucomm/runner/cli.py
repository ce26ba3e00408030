"""``gpucomm-run``: start an N-rank job on this host or several, as ``horovodrun`` does.

    gpucomm-run -np 4 -H host1:2,host2:2 python train.py

The launcher serves the job's authenticated rendezvous store itself, makes a fresh random secret
per run, exports each rank's place (``GPUCOMM_*`` and ``HOROVOD_*``), prefixes every output line
with the rank, and stops the whole job when any rank fails.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import socket
import sys
from typing import Any, Callable, Mapping, Sequence

from ..errors import GpucommError
from ..failures import read_failures
from ..bootstrap.netaddr import (WILDCARD, InterfaceError, address_for_peers, address_towards, host_port,
                                 interface_address, is_ipv6, is_loopback, resolves_here, unbracket)
from ..bootstrap.rendezvous import RendezvousServer
from ..settings import GLOO_IFACE, START_TIMEOUT, SettingError, liveness_seconds, settings_problems
from .check_build import check_build_report
from .discovery import DiscoveryScript, FixedHosts
from .elastic_driver import ElasticDriver, make_limits
from .hosts import HostSlots, HostSpecError, assign_slots, parse_hostfile, parse_hosts
from .mpi_launch import MpiJobEnd, run_mpi_job
from .output import OutputSink
from .spawn import SshOptions, build_launches, is_local, split_user, ssh_hostname
from .supervisor import Supervisor
from .cli_parser import DEFAULT_START_TIMEOUT, build_parser


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


def nic_address(nic: str, *, ipv6: bool | None = None) -> str:
    """The address of the chosen network interface (``interface_ip``: IPv4, else global IPv6; ``ipv6``: that
    family alone), or ``SystemExit`` naming the ones that exist."""
    try:
        return interface_address(nic, "--network-interface, or GPUCOMM_GLOO_IFACE / HOROVOD_GLOO_IFACE", ipv6=ipv6)
    except InterfaceError as e:
        raise SystemExit(f"gpucomm-run: {e}") from None


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
    (``chosen_nic``) in the family the remote hosts are reached in, else this host's address towards the
    first remote host, else loopback. ``SystemExit`` where the remote hosts are reached in different families
    (some over IPv4 only, some over IPv6 only): their ranks could not all reach one store, nor each other."""
    remote_hosts = [h for h in hosts if not is_local(h)]
    nic = chosen_nic(tunables, os.environ if env is None else env)
    routes = {}
    for host in remote_hosts:
        try:
            route = address_towards(ssh_hostname(host, ssh_options(args)))
        except GpucommError:  # no route and no address of this host's own name: said below, or the NIC decides
            continue
        if not is_loopback(route):  # (a fallback to this host's own name, not a route: address_for_host decides)
            routes[host] = route
    families = {"IPv6" if is_ipv6(a) else "IPv4": [h for h, b in routes.items() if is_ipv6(b) == is_ipv6(a)]
                for a in routes.values()}
    if len(families) > 1:
        raise SystemExit(f"gpucomm-run: this host reaches {', '.join(families['IPv4'])} over IPv4 and "
                         f"{', '.join(families['IPv6'])} over IPv6 (its address on the route towards each), and every "
                         f"rank must reach one store and every other rank, in one family. Fix: give every host an "
                         f"address in one family and name the hosts so (an /etc/hosts or DNS name per host, or "
                         f"addresses in -H), or leave out the hosts of the other family.")
    if nic:
        return nic_address(nic, ipv6=True if set(families) == {"IPv6"} else None)
    if remote_hosts:
        try:
            return address_for_host(args, remote_hosts[0])
        except GpucommError as e:  # said before any rank starts
            raise SystemExit(f"gpucomm-run: {e}") from None
    return "127.0.0.1"


def ssh_options(args: argparse.Namespace, connect_timeout: float = 30.0) -> SshOptions:
    """The ssh options gpucomm-run's flags give (-p, -i, --ssh-args)."""
    return SshOptions(args.ssh_port, args.ssh_identity_file, connect_timeout, args.remote_python,
                      tuple(shlex.split(args.ssh_args)))


class NoRouteToHost(GpucommError):
    """This host has no address that the ranks on a listed host could reach its store on."""


def address_for_host(args: argparse.Namespace, host: str) -> str:
    """This host's address on the route towards ``host`` of the host list: towards the HostName ssh connects to
    (``ssh -G``: a ~/.ssh/config alias's). Where that is loopback while ``host`` is not this machine (an alias
    to a forwarded port on localhost, a name that resolves nowhere here, as behind a ProxyJump), the address other
    machines reach this one on (its default route's). Raises ``NoRouteToHost`` where that is loopback too: the
    ranks there could not reach the store, and would wait out the start timeout for it."""
    listed = unbracket(split_user(host)[1])
    name = ssh_hostname(host, ssh_options(args))
    addr = address_towards(name)
    if not is_loopback(addr) or resolves_here(listed):
        return addr
    addr = address_for_peers(socket.gethostname(), warn=False)
    if not is_loopback(addr):
        return addr
    resolved = "does not resolve here, and `ssh -G` gives no other HostName for it (or could not be run)" \
        if name.lower() == listed.lower() else f"is {name} to ssh (its HostName)"
    raise NoRouteToHost(
        f"this host's address towards {host!r} is {addr}, a loopback address, which the ranks there cannot reach: "
        f"{host!r} {resolved}, and this host's own name ({socket.gethostname()!r}) resolves to loopback (Debian's "
        f"/etc/hosts does this), with no default route or single other address to take instead. Fix: "
        f"--network-interface IF, naming the interface the hosts share; or make {host!r} resolve here (/etc/hosts, "
        f"DNS).")


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
            sink.say(f"job {run_id}: {args.np} rank(s); rendezvous store at {host_port(addr, server.port)}")
            for s in slots:
                sink.say(f"  rank {s.rank}: host {s.host} local {s.local_rank}/{s.local_size} "
                         f"cross {s.cross_rank}/{s.cross_size}" + (" (ssh)" if s.host in remote_hosts else ""))
        launches = build_launches(
            slots, command, env, tunables, rendezvous_addr=lambda host: addr, rendezvous_port=server.port,
            secret=secret, run_id=run_id, cwd=os.getcwd(),
            ssh=ssh_options(args, start_timeout),
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
    addr = nic_address(nic) if nic else WILDCARD  # (every interface: hosts may be reached over IPv4 or IPv6)
    sink = OutputSink(1, args.output_filename, timestamps=args.prefix_output_with_timestamp)
    with RendezvousServer(secret, addr, 0) as server:
        def store_address(host: str) -> str:  # loopback here; towards the launcher from other hosts
            if nic:
                return addr
            if is_local(host):
                return "127.0.0.1"
            try:
                return address_for_host(args, host)
            except NoRouteToHost as e:  # its workers fail to reach the store; the job goes on without the host
                sink.say(f"{e} Workers on {host} will not reach the store.")
                return "127.0.0.1"

        driver = ElasticDriver(discovery, limits, list(args.command), env, tunables, server,
                               rendezvous_addr=store_address,
                               secret=secret, run_id=run_id, sink=sink,
                               ssh=ssh_options(args, float(tunables["GPUCOMM_START_TIMEOUT"])),
                               grace=args.stop_grace, verbose=args.verbose)
        return driver.run()


def console_main() -> None:
    """Entry point of the ``gpucomm-run`` console script."""
    sys.exit(main())


__all__ = ["NoRouteToHost", "address_for_host", "build_parser", "chosen_nic", "console_main", "main", "nic_address", "omp_threads",
           "refused_settings", "remote_silence", "run_fixed_job", "run_through_mpi", "ssh_options", "store_address",
           "tunables_env"]
