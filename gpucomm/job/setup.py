"""``init``'s steps: meet at the rendezvous store, pin this rank's GPU, wait for every rank to
arrive, build the job's CPU backend (a Gloo group, or an MPI communicator under an MPI launcher)
and connect the control plane; the result is a ``Job``."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Mapping

from ..backends.cpu_operations import CpuOperations, explain_cpu_operations
from ..backends.gloo import GlooDevice, gloo_group, gloo_iface
from ..backends.local import SelfBackend
from ..backends.mpi import mpi_world
from ..bootstrap import devices
from ..bootstrap.arrival import arrive, claim_arrival, conflict_key, cross_placement, open_store, watch_conflicts
from ..bootstrap.netaddr import (DEFAULT_ROUTE_PROBE, InterfaceError, address_for_peers, host_port, interface_address,
                                 interface_of, is_ipv6)
from ..bootstrap.rendezvous import RendezvousClient, RendezvousError, wait_for_ranks
from ..bootstrap.world import World, detect_world
from ..control.channel import ControlListener, connect as connect_control
from ..control.controller import ControlConfig, ControlLinks
from ..errors import GpucommError
from ..logs import SetupSteps, configure_logging
from ..process_sets import init_sets
from ..settings import AUTOTUNE, RENDEZVOUS_BIND, REQUIRE_SECRET, START_TIMEOUT, TIMEOUT, check_settings
from .elastic import JoinedRound, round_interrupt
from .stack_check import check_same_stack, gpu_stack, software_stack
from .state import SHUTDOWN_GRACE, Job

log = logging.getLogger("gpucomm")

DEFAULT_TIMEOUT = 300.0  # seconds a collective may take before it is declared failed
DEFAULT_START_TIMEOUT = 120.0  # seconds all ranks have to reach init()
_autotune_explained = False  # the one-rank job's "autotune is off" is said once per process


def build_job(env: Mapping[str, str], generation: int, process_sets: Any = None,
              joined: JoinedRound | None = None) -> Job:
    """Join the job ``env`` describes; ``generation`` keeps a re-init's store keys apart from the last one's.
    An elastic worker passes the round it joined (``joined.env`` places it in that round)."""
    elastic_round = joined.number if joined is not None else 0
    if joined is not None:
        env = joined.env
    check_settings(env)  # every setting, on every rank, before rank 0 serves the store: all fail alike, at once
    world = detect_world(env)
    configure_logging(env, world.rank)
    steps = SetupSteps()
    _explain_autotune_off(world, env)
    static_sets, dynamic_sets = init_sets(process_sets, world.size, env)
    control = ControlConfig.from_env(env, TIMEOUT.read(env, DEFAULT_TIMEOUT), local_size=world.local_size)
    timeout = control.timeout
    start_timeout = START_TIMEOUT.read(env, DEFAULT_START_TIMEOUT)
    t0 = time.monotonic()
    prefix = f"{world.run_id}/e{elastic_round}/" if elastic_round else f"{world.run_id}/g{generation}/"
    record: dict[str, Any] = {"host": world.hostname, "local_rank": world.local_rank, "pid": os.getpid(),
                              "stack": software_stack(),
                              # (elastic) in an earlier round of this job: its install is the job's
                              "veteran": joined is not None and joined.veteran}
    transport = _decide_cpu_operations(world, env)  # before the store: it may initialize MPI (see there)
    server, client = open_store(world, generation, start_timeout, timeout, prefix=prefix, record=record,
                                require_secret=REQUIRE_SECRET.read(env, False), bind=RENDEZVOUS_BIND.read(env),
                                dead_peer_after=control.liveness_timeout)
    steps.done(f"rendezvous store at {host_port(client.host, client.port)} reached (launcher: {world.launcher})")
    # a replaced round stops the waits
    interrupt = round_interrupt(client, world.run_id, elastic_round) if elastic_round else None
    listener = None
    try:
        single_gpu = devices.single_gpu_test_enabled(env)
        in_use = devices.device_in_use()  # the script's choice, before pinning may start CUDA itself
        pinned = _pin_gpu(client, server, prefix, world, record, single_gpu, start_timeout)
        steps.done(f"device chosen: {pinned or 'CPU'}")
        choice = _record_cpu_operations(transport, client, server, prefix, world, record, start_timeout)
        _check_gloo_iface(env, client, server, prefix, world, record, start_timeout, choice,
                          elastic=bool(elastic_round))
        records = arrive(client, prefix, world, record, start_timeout, interrupt)
        steps.done(f"all {world.size} ranks arrived")
        _check_records(client, server, prefix, world, records, single_gpu, start_timeout)
        cross_rank, cross_size = cross_placement(world, records)
        hosts = [rec["host"] for rec in records]
        one_host = len(set(hosts)) == 1
        reached_at = None if one_host else _reached_at(world, gloo_iface(env))
        gloo_device = _gloo_device(gloo_iface(env), reached_at)
        cpu = _cpu_backend(choice, world, client, prefix, timeout, gloo_device, interrupt, steps)
        try:
            links, listener = _connect_control(client, prefix, world, client.secret, reached_at, start_timeout,
                                               records, interrupt)
            steps.done("control plane connected" if world.size > 1 else "no control plane needed (one rank)")
        except BaseException:
            cpu.close(abort=True)
            raise
    except BaseException:
        if listener is not None:
            listener.close()
        client.close()
        if server is not None:
            server.close()
        raise
    log.info("init: rank %d of %d ready in %.2f s (device %s)", world.rank, world.size, time.monotonic() - t0,
             pinned or "CPU")
    try:
        job = Job(world, client, server, prefix, timeout, cpu, pinned, hosts, cross_rank, cross_size, control,
                  links, static_sets, dynamic_sets, elastic_round,
                  new_workers_joined=joined is not None and joined.new_workers, caller_gpu=in_use,
                  gloo_device=gloo_device)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        _fail_on_second_claims(job, listener)
    return job


def _explain_autotune_off(world: World, env: Mapping[str, str]) -> None:
    """Autotune tunes how gradients are communicated; a one-rank job communicates nothing, so the
    optimizer never starts it. Say so once per process when the environment asks for it."""
    global _autotune_explained
    given = AUTOTUNE.given(env)
    if world.size > 1 or given is None or not AUTOTUNE.read(env) or _autotune_explained:
        return
    _autotune_explained = True
    log.warning("gpucomm autotune: %s=%s asks for autotune, but autotune is off in a one-rank job: there is no "
                "communication to tune (DistributedOptimizer reduces nothing at one rank). Run with 2 or more ranks "
                "to tune, or unset %s.", given[0], given[1].strip(), given[0])


def _cpu_backend(choice: CpuOperations | None, world: World, client: RendezvousClient, prefix: str, timeout: float,
                 gloo_device: GlooDevice, interrupt, steps: SetupSteps):
    """The job's CPU backend: ``SelfBackend`` in a one-rank job (``choice`` None); else an MPI communicator
    over every rank or a Gloo group, as ``choice`` says. Every rank builds it at this point. An
    elastic job is always on Gloo (``explain_cpu_operations``): its rounds change the ranks, which
    an MPI communicator cannot."""
    if choice is None:  # nothing to exchange: CPU collectives are computed locally
        return SelfBackend()
    if choice.name == "mpi":
        cpu = mpi_world(timeout=timeout, expected_rank=world.rank, expected_size=world.size, label=f"{prefix}world")
        steps.done(f"CPU collectives on MPI ({choice.reason})")
        return cpu
    cpu = gloo_group(client, f"{prefix}gloo/", world.rank, world.size, timeout=timeout, device=gloo_device,
                     interrupt=interrupt)
    steps.done(f"CPU collectives on Gloo ({choice.reason})")
    return cpu


def _fail_on_second_claims(job: Job, listener: ControlListener) -> None:
    """Rank 0: once a second process claims a rank (at the store or the control listener), fail
    the job on every rank with its message; the watch ends with the job (its client closes). Where
    the launcher serves the store, losing it fails the job too (``_store_lost``)."""
    def fail(message: str) -> None:
        controller = job.controller
        if controller is not None and controller.failure() is None:
            controller.abort(message)  # the job's failure as such, not "rank 0 failed: ..."

    on_lost = (lambda error: fail(_store_lost(job, error))) if job.server is None else None
    watch_conflicts(job.client, job.prefix, fail, on_exit=listener.close, on_lost=on_lost)


def _store_lost(job: Job, error: str) -> str:
    """The job's error when rank 0 lost the store its launcher serves: the launcher then follows the
    job no more (its output, its failures, its next elastic round), so the job must not go on."""
    return (f"rank 0 lost the job's rendezvous store at {host_port(job.client.host, job.client.port)}, which the launcher "
            f"serves on that host: {error} Without it the launcher cannot follow the job (its output, its failures), "
            f"so the job ends on every rank. Likely causes: the launcher's host lost the network (a cut link, a "
            f"partition) or went down, or the launcher was killed. GPUCOMM_LIVENESS_TIMEOUT bounds how long an "
            f"unanswered store is waited for.")


def _pin_gpu(client: RendezvousClient, server, prefix: str, world: World, record: dict, single_gpu: bool,
             start_timeout: float):
    """This rank's GPU (or None); a failure is published as this rank's arrival record first, so
    every rank fails with its message instead of waiting for it."""
    try:
        if single_gpu:
            devices.apply_single_gpu_test_env(world.rank, os.environ)
        pinned = devices.pin_local_gpu(world.local_rank, world.local_size, single_gpu_test=single_gpu,
                                       hostname=world.hostname)
        record["bus_id"] = pinned.gpu.pci_bus_id if pinned else None
        if pinned:  # the NCCL its collectives will use: every rank with a GPU must load the same one
            record["stack"].update(gpu_stack())
        return pinned
    except Exception as e:
        _publish_failure(client, server, prefix, world, record, e, start_timeout)
        raise


def _check_gloo_iface(env: Mapping[str, str], client: RendezvousClient, server, prefix: str, world: World,
                      record: dict, start_timeout: float, choice: CpuOperations | None, *, elastic: bool) -> None:
    """The interface GPUCOMM_GLOO_IFACE names must exist here, with an address other hosts reach, where Gloo uses it.
    Interface names can differ between hosts (eth0 here, ens5 there): a rank that lacks it is published as
    failed at arrival, so every rank fails at once naming it. Before, it failed in Gloo alone, and the others
    waited out GPUCOMM_TIMEOUT for its Gloo keys ('1 of 1 keys were not set ... /gloo/0/0'). Under MPI no
    Gloo group is made (the variable may be set for all hosts by --network-interface). In an elastic round
    the rank raises alone: its worker exits, the launcher leaves its host out, and the round re-forms."""
    iface = gloo_iface(env)
    if world.size == 1 or not iface or (choice is not None and choice.name == "mpi"):
        return
    try:
        interface_address(iface, "GPUCOMM_GLOO_IFACE / HOROVOD_GLOO_IFACE")
    except InterfaceError as e:
        error = InterfaceError(f"{e} This is host {world.hostname}: interface names can differ between hosts (eth0, "
                               f"ens5), so set the variable per host to that host's name for the shared network, or "
                               f"leave it unset (gpucomm then takes the interface on the route to the store).")
        if not elastic:
            _publish_failure(client, server, prefix, world, record, error, start_timeout)
        raise error from None


def _decide_cpu_operations(world: World, env: Mapping[str, str]) -> CpuOperations | Exception | None:
    """This rank's CPU transport (None in a one-rank job), or why the one asked for cannot serve.

    Decided before rank 0 opens the store: choosing MPI initializes it, and ``MPI_Init_thread``
    waits for every rank of the MPI launcher while holding the GIL, so in rank 0 it would starve
    the store's thread while the other ranks wait to reach the store (a deadlock whenever rank 0
    got there first). Every rank initializes MPI first, then meets at the store."""
    if world.size == 1:
        return None
    try:
        return explain_cpu_operations(env)
    except Exception as e:  # noqa: BLE001 - published at arrival (``_record_cpu_operations``), then raised
        return e


def _record_cpu_operations(decided: CpuOperations | Exception | None, client: RendezvousClient, server, prefix: str,
                           world: World, record: dict, start_timeout: float) -> CpuOperations | None:
    """Put this rank's CPU transport in its arrival record, so that every rank can check that all
    chose alike; a failure (MPI asked for and unavailable) is published the same way, so every
    rank fails with its message instead of waiting for this one."""
    if isinstance(decided, Exception):
        _publish_failure(client, server, prefix, world, record, decided, start_timeout)
        raise decided
    if decided is not None:
        record["cpu_operations"] = decided.name
    return decided


def _publish_failure(client: RendezvousClient, server, prefix: str, world: World, record: dict, error: Exception,
                     start_timeout: float) -> None:
    """Arrive with ``error`` in this rank's record: every rank's ``arrive`` raises with it."""
    record["error"] = f"{type(error).__name__}: {error}"
    claim_arrival(client, prefix, world, record)  # a second claimant of this rank raises its own error here
    if _serve_until_all(client, server, f"{prefix}arrive", world, start_timeout):
        time.sleep(0.5)  # (their arrival, not their read, is what this rank can see)


def _serve_until_all(client: RendezvousClient, server, key: str, world: World, start_timeout: float) -> bool:
    """(a rank that is failing ``init()``) Where this rank serves the store (``server``), keep serving until
    every rank has set ``{key}/{rank}``, at most a grace: the others are still reading why. True when
    all did."""
    if server is None:
        return False
    try:
        wait_for_ranks(client, key, range(world.size), min(start_timeout, SHUTDOWN_GRACE), "init")
        return True
    except RendezvousError:
        return False


def _check_records(client: RendezvousClient, server, prefix: str, world: World, records: list[dict],
                   single_gpu: bool, start_timeout: float) -> None:
    """What every rank must agree on, read from every rank's arrival record (the same records
    everywhere, so every rank raises alike): the installs, the CPU transport, one GPU per rank. A
    rank that raises says so in the store first, and rank 0, where it serves the store, keeps
    serving until every rank has (or a grace has passed): else the others, still reading the
    records, would fail on the store's closed connection instead of with the reason."""
    try:
        check_same_stack(records, world.rank)
        _check_cpu_operations(records)
        gpus = [(r, rec["host"], rec["bus_id"]) for r, rec in enumerate(records) if rec.get("bus_id")]
        devices.check_unique_assignment(gpus, single_gpu_test=single_gpu)
    except Exception:
        try:
            client.set(f"{prefix}refused/{world.rank}", b"1")
        except RendezvousError:
            pass  # (a store already gone: nobody is left to read it)
        _serve_until_all(client, server, f"{prefix}refused", world, start_timeout)
        raise


def _check_cpu_operations(records: list[dict]) -> None:
    """Every rank must move CPU tensors on the same transport (one MPI rank would wait forever for
    Gloo peers); each rank sees every record, so all raise alike."""
    chosen: dict[str, list[int]] = {}
    for r, rec in enumerate(records):
        chosen.setdefault(str(rec.get("cpu_operations")), []).append(r)
    if len(chosen) > 1:
        sides = "; ".join(f"ranks {ranks} chose {name}" for name, ranks in chosen.items())
        raise GpucommError(f"the ranks chose different transports for CPU collectives ({sides}), so they could never "
                           f"exchange data. Likely cause: mpi4py is importable (or its MPI library loads) on some "
                           f"hosts only, or GPUCOMM_CPU_OPERATIONS differs between ranks. Fix: set "
                           f"GPUCOMM_CPU_OPERATIONS=gloo or =mpi for every rank, or install mpi4py on every host.")


def _connect_control(client: RendezvousClient, prefix: str, world: World, secret: bytes, reached_at: str | None,
                     start_timeout: float, records: list[dict],
                     interrupt=None) -> tuple[ControlLinks, ControlListener | None]:
    """Connect every rank to rank 0's coordinator (a one-rank job has no control plane);
    ``interrupt`` may stop the waits (elastic rounds). Rank 0 also returns its listener, which
    keeps reporting second claimants of a rank (``records`` say who arrived as each) to the store. It listens
    on ``reached_at`` (``_reached_at``; None: every rank is on this host, loopback)."""
    if world.size == 1:
        return ControlLinks(), None
    key = f"{prefix}control"
    hosts = tuple(str(rec.get("host")) for rec in records)
    if world.rank == 0:
        host = reached_at or "127.0.0.1"
        listener = ControlListener(secret, host)  # only the address the other ranks are told
        client.set(key, json.dumps({"host": host, "port": listener.port}).encode())
        claimants = {r: (str(rec.get("host")), rec.get("pid")) for r, rec in enumerate(records)}

        def conflict(message: str) -> None:
            try:
                client.set(conflict_key(prefix), message.encode())
            except RendezvousError:
                pass  # the job is over

        workers = listener.accept(list(range(1, world.size)), start_timeout, interrupt, claimants=claimants,
                                  on_conflict=conflict)
        return ControlLinks(workers=workers, hosts=hosts), listener
    if interrupt is not None:
        deadline = time.monotonic() + start_timeout
        while not client.check([key]) and time.monotonic() < deadline:
            interrupt()
            time.sleep(0.05)
    where = json.loads(client.get(key, start_timeout))
    return ControlLinks(to_root=connect_control(where["host"], where["port"], secret, world.rank, start_timeout,
                                                me=world.hostname), hosts=hosts), None


def _reached_at(world: World, iface: str | None) -> str:
    """Across hosts, the address other hosts reach this rank on: the chosen interface's (GPUCOMM_GLOO_IFACE), in
    the family of the route to the store, else the address on that route. The job's hosts reach each other in
    one family: an interface's IPv4 address given to an IPv6 job (or the reverse) is an address the others
    cannot reach, or one Gloo cannot pair with theirs ('ss1.ss_family == ss2.ss_family. 2 vs 10')."""
    towards = address_for_peers(world.rendezvous_addr or DEFAULT_ROUTE_PROBE)
    if not iface:
        return towards
    return interface_address(iface, "GPUCOMM_GLOO_IFACE / HOROVOD_GLOO_IFACE", ipv6=is_ipv6(towards))


def _gloo_device(iface: str | None, reached_at: str | None) -> GlooDevice:
    """Where this rank's Gloo groups listen (the world's, and each process set's: ``Job.gloo_device``). On one
    host, loopback (or the chosen interface). Across hosts over IPv4, the chosen interface, else the one on
    the route to the store: Gloo's own choice is the address this host's name resolves to, which on many hosts
    is 127.0.1.1 (Debian's /etc/hosts), so it would listen on loopback and tell the other hosts to connect there
    ('connectFullMesh failed ... remote=[127.0.1.1]'). Over IPv6, the address itself: given an interface, Gloo
    takes its first address, the IPv4 one where it has both."""
    if reached_at is None:
        return GlooDevice(interface=iface) if iface else GlooDevice(hostname="127.0.0.1")
    if is_ipv6(reached_at):
        return GlooDevice(hostname=reached_at)
    return GlooDevice(interface=iface or interface_of(reached_at))


__all__ = ["DEFAULT_START_TIMEOUT", "DEFAULT_TIMEOUT", "build_job"]
