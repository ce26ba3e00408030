"""Lifecycle of one job in this process: ``init`` builds world → rendezvous → device → backends →
engine; ``shutdown`` takes them down in reverse. Re-init after shutdown starts a new generation,
whose store keys never collide with the last one's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from . import failures
from .bootstrap import devices
from .backends.gloo import GlooBackend
from .control.controller import ControlConfig, Controller
from .control.coordinator import Coordinator
from .dataplane.handles import Handle
from .errors import GpucommError, NotInitializedError
from .dataplane.executor import Executor
from .dataplane.inline import reduce_inline
from .dataplane.requests import Request
from .control.channel import ControlListener, connect as connect_control
from .dataplane.groups import Group
from .process_sets import check_members
from .timeline.tracing import Tracer
from .bootstrap.rendezvous import (RendezvousClient, RendezvousError, RendezvousServer, address_towards, interface_ipv4,
                         wait_for_ranks)
from .settings import env_flag, env_seconds
from .bootstrap.world import World, detect_world

log = logging.getLogger("gpucomm")

DEFAULT_TIMEOUT = 300.0  # seconds a collective may take before it is declared failed
DEFAULT_START_TIMEOUT = 120.0  # seconds all ranks have to reach init()
SHUTDOWN_GRACE = 10.0  # rank 0 keeps serving the store this long for ranks still shutting down


@dataclass
class Runtime:
    """Everything one initialized job owns in this process."""

    world: World
    client: RendezvousClient
    server: RendezvousServer | None
    prefix: str
    timeout: float
    gloo: GlooBackend
    device: devices.PinnedDevice | None
    hosts: list[str]
    cross_rank: int
    cross_size: int
    control: ControlConfig
    links: tuple = (None, {})  # (channel to rank 0, or None in rank 0; rank 0's channels to the others)
    static_sets: list[tuple[int, ...]] = field(default_factory=list)
    dynamic_sets: bool = False
    controller: Controller = field(init=False)
    groups: dict[int, Group] = field(init=False)
    _nccl: Any = None
    _nccl_lock: threading.Lock = field(default_factory=threading.Lock)
    _set_counter: int = 0
    join_device: int = -1  # hvd.join(device=...): the GPU for zero stand-ins; -1: this rank's GPU
    tracer: Tracer | None = None  # rank 0's timeline while one is recording

    def __post_init__(self) -> None:
        rank, size = self.world.rank, self.world.size
        self.groups = {0: Group(0, range(size), rank, lambda g: self.gloo, lambda g: self.nccl())}
        for set_id, ranks in enumerate(self.static_sets, start=1):
            self.groups[set_id] = self._group(set_id, ranks)
        link, workers = self.links
        coordinator = None
        if rank == 0:
            coordinator = Coordinator(size, cache_capacity=self.control.cache_capacity, process_sets=self.static_sets,
                                      reduce_inline=reduce_inline)
        self._coordinator = coordinator
        self.controller = Controller(rank, size, Executor(self.group, self._current_tracer), self.control,
                                     coordinator=coordinator, workers=workers, link=link, on_done=self._on_done,
                                     zeros_device=self._zeros_device, tracer=self._current_tracer,
                                     nccl_health=self._nccl_health)

    def _nccl_health(self, set_id: int, abort: bool) -> str | None:
        """For the watchdog: NCCL's asynchronous error on ``set_id``'s communicator, or abort it."""
        group = self.groups.get(set_id)
        backend = group.nccl_if_created() if group is not None else None
        if backend is None:
            return None
        if abort:
            backend.abort()
            return None
        try:
            backend.check_async_error()
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            return str(e)
        return None

    # -- timeline (rank 0 writes it) -------------------------------------------------------------
    def _current_tracer(self) -> Tracer | None:
        return self.tracer

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Record a Horovod-format timeline to ``path`` (rank 0; other ranks ignore the call)."""
        if self.world.rank != 0:
            return
        self.stop_timeline()
        tracer = Tracer(path, mark_cycles=mark_cycles)
        self.tracer = tracer
        if self._coordinator is not None:
            self._coordinator.observer = tracer
        log.info("timeline: recording to %s", path)

    def stop_timeline(self) -> None:
        tracer, self.tracer = self.tracer, None
        if self._coordinator is not None:
            self._coordinator.observer = None
        if tracer is not None:
            tracer.close()

    # -- process sets ----------------------------------------------------------------------------
    def group(self, set_id: int) -> Group:
        group = self.groups.get(set_id)
        if group is None:
            raise ValueError(f"process set {set_id} is not registered on this rank (it was removed, or never added).")
        return group

    def _group(self, set_id: int, ranks) -> Group:
        return Group(set_id, ranks, self.world.rank, self._set_gloo, self._set_nccl)

    def _set_gloo(self, group: Group) -> GlooBackend:
        return _gloo(self.client, f"{self.prefix}gloo/ps{group.id}/", group.rank, group.size, self.timeout,
                     self.hosts, _gloo_iface(os.environ))

    def _set_nccl(self, group: Group):
        return self._make_nccl(f"{self.prefix}nccl/ps{group.id}/uid", group.rank, group.size)

    def _on_done(self, kind: str, name: str, value: Any) -> None:
        """Responses that change process sets (applied in the driver thread, in response order)."""
        if name.startswith("process_set.add.") and isinstance(value, tuple):
            set_id, ranks = value
            self.groups[set_id] = self._group(set_id, ranks)
        elif name.startswith("process_set.remove.") and isinstance(value, int):
            group = self.groups.pop(value, None)
            if group is not None:
                group.close()

    def next_set_name(self, what: str) -> str:
        self._set_counter += 1
        return f"process_set.{what}.{self._set_counter}"

    # -- backends --------------------------------------------------------------------------------
    def _cuda_device(self) -> torch.device:
        return torch.device("cuda", self.device.cuda_ordinal if self.device is not None else torch.cuda.current_device())

    def _zeros_device(self) -> torch.device:
        return torch.device("cuda", self.join_device) if self.join_device >= 0 else self._cuda_device()

    def nccl(self):
        """The NCCL backend of the whole job, created by the first CUDA collective (the same call on
        every rank, since every rank runs collectives in the same order)."""
        with self._nccl_lock:
            if self._nccl is None:
                self._nccl = self._make_nccl(f"{self.prefix}nccl/uid", self.world.rank, self.world.size)
            return self._nccl

    def _make_nccl(self, key: str, rank: int, size: int):
        from .backends.nccl import NcclBackend, nccl_module  # noqa: PLC0415

        nccl = nccl_module()
        if nccl is None:
            raise GpucommError(
                "a collective on a CUDA tensor needs NCCL, but CuPy's NCCL bindings could not be loaded. "
                "Install the extra that matches your CUDA: pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]'.")
        t0 = time.monotonic()
        if rank == 0:
            self.client.set(key, bytes(nccl.get_unique_id()))
        uid = self.client.get(key, self.timeout)
        backend = NcclBackend(uid, rank, size, self._cuda_device().index)
        log.info("NCCL communicator (%s, rank %d of %d) created in %.3f s", key, rank, size, time.monotonic() - t0)
        return backend

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, request: Request, *, send: str = "cycle") -> Handle:
        """Hand ``request`` to the control plane (``Controller.submit`` explains ``send``)."""
        if request.device.type == "cuda":
            request.ready_event = torch.cuda.Event()
            request.ready_event.record(torch.cuda.current_stream(request.device))
        return self.controller.submit(request, send=send)

    def close(self) -> None:
        self.controller.stop()
        if self.world.rank == 0:
            self.controller.wait_workers_gone(SHUTDOWN_GRACE)
        for group in list(self.groups.values())[1:]:
            group.close()
        if self._nccl is not None:
            self._nccl.close()
        self.gloo.close()
        try:
            self.client.add(f"{self.prefix}shutdown", 1)
            if self.server is not None:
                self._wait_for_others_to_leave()
        except RendezvousError as e:
            log.debug("shutdown: store already gone: %s", e)
        self.controller.close()
        self.stop_timeline()
        self.client.close()
        if self.server is not None:
            self.server.close()

    def _wait_for_others_to_leave(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_GRACE
        while time.monotonic() < deadline:
            if self.client.add(f"{self.prefix}shutdown", 0) >= self.world.size:
                return
            time.sleep(0.01)
        log.warning("gpucomm shutdown: not every rank shut down within %.0f s; closing the rendezvous store anyway",
                    SHUTDOWN_GRACE)


_runtime: Runtime | None = None
_generation = 0
_lock = threading.Lock()


def current() -> Runtime:
    """The initialized runtime, or ``NotInitializedError`` (a ValueError, as in Horovod)."""
    rt = _runtime
    if rt is None:
        raise NotInitializedError()
    return rt


def is_initialized() -> bool:
    return _runtime is not None


def init(process_sets: Sequence[Sequence[int]] | str | None = None) -> Runtime:
    """Join the job described by the environment; idempotent while initialized.

    ``process_sets``: the ranks of each process set to register now (ids 1, 2, ... in order, the
    same list on every rank), or ``"dynamic"`` to allow ``add_process_set`` later."""
    global _runtime, _generation
    with _lock:
        if _runtime is not None:
            return _runtime
        _generation += 1
        rt = _runtime = _build(os.environ, _generation, process_sets)
        failures.set_reporter(lambda exc: _report(rt, exc))
        path = os.environ.get("GPUCOMM_TIMELINE") or os.environ.get("HOROVOD_TIMELINE")
        if path and path.upper() != "DYNAMIC":
            try:
                rt.start_timeline(path, mark_cycles=env_flag(os.environ, ("GPUCOMM_TIMELINE_MARK_CYCLES",
                                                                          "HOROVOD_TIMELINE_MARK_CYCLES")))
            except BaseException:
                _runtime = None
                rt.close()
                raise
        return rt


def _report(rt: Runtime, exc: BaseException) -> None:
    """An uncaught exception is ending this rank: tell the coordinator (so every rank names it as
    the cause) and the store (so the launcher does)."""
    text = failures.summarize(exc)
    rt.controller.report_failure(text)
    failures.record_failure(rt.client, rt.world.run_id, rt.world.rank, rt.world.hostname, text)


def shutdown() -> None:
    """Leave the job; pending operations fail with ``ShutdownError``. Safe to call twice."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    failures.set_reporter(None)
    if rt is not None:
        rt.close()


atexit.register(shutdown)


# ---------------------------------------------------------------------------------------------
# building a runtime


def _torch_store_rendezvous(world: World, gen: int, start_timeout: float):
    """Under torchrun: rank 0 serves our store on a free port and publishes it, with a fresh secret,
    through torchrun's own TCPStore at MASTER_ADDR:MASTER_PORT."""
    import datetime

    import torch.distributed as dist

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(world.rendezvous_addr, world.rendezvous_port, world.size,
                          is_master=(world.rank == 0 and not agent_store),
                          timeout=datetime.timedelta(seconds=start_timeout), wait_for_workers=False)
    key = f"gpucomm/{world.run_id}/g{gen}/rendezvous"
    server = None
    if world.rank == 0:
        secret = world.secret or secrets.token_bytes(32)
        server = RendezvousServer(secret, "0.0.0.0", 0)
        host = address_towards(world.rendezvous_addr, world.rendezvous_port)
        store.set(key, json.dumps({"host": host, "port": server.port, "secret": secret.hex()}))
    info = json.loads(store.get(key))
    return server, info["host"], info["port"], bytes.fromhex(info["secret"])


def _open_store(world: World, gen: int, start_timeout: float, timeout: float):
    """Start (rank 0) and connect to the rendezvous store; returns (server, client)."""
    if world.launcher == "none":
        secret = secrets.token_bytes(32)
        server = RendezvousServer(secret, "127.0.0.1", 0)
        return server, RendezvousClient("127.0.0.1", server.port, secret, connect_timeout=start_timeout, timeout=timeout)
    if world.port_via_torch_store:
        server, host, port, secret = _torch_store_rendezvous(world, gen, start_timeout)
    else:
        host, port = world.rendezvous_addr, world.rendezvous_port
        secret = world.secret or secrets.token_bytes(32)
        if world.secret is None and world.size > 1:
            raise GpucommError(f"the {world.launcher} launcher gave no job secret; set GPUCOMM_SECRET to the same "
                               f"random hex string (32+ characters) on every rank.")
        server = None
        if world.rank == 0 and not world.rendezvous_hosted:
            try:
                server = RendezvousServer(secret, "0.0.0.0", port)
            except OSError as e:
                raise GpucommError(
                    f"rank 0 could not serve the rendezvous store on port {port}: {e}. Another process holds the "
                    f"port (perhaps an earlier job still running); set GPUCOMM_RENDEZVOUS_PORT to a free port on "
                    f"every rank.") from e
    try:
        client = RendezvousClient(host, port, secret, connect_timeout=start_timeout, timeout=timeout)
    except Exception:
        if server is not None:
            server.close()
        raise
    return server, client


def _arrive(client: RendezvousClient, prefix: str, world: World, record: dict, start_timeout: float) -> list[dict]:
    """Publish this rank's record and read everyone's; a rank that failed before arriving (its
    record carries ``error``) makes every rank fail with that rank's message."""
    client.set(f"{prefix}arrive/{world.rank}", json.dumps(record).encode())
    wait_for_ranks(client, f"{prefix}arrive", range(world.size), start_timeout, "gpucomm.init()")
    records = [json.loads(client.get(f"{prefix}arrive/{r}")) for r in range(world.size)]
    for r, rec in enumerate(records):
        if rec.get("error"):
            raise GpucommError(f"rank {r} failed in gpucomm.init(): {rec['error']}")
    return records


def _cross(world: World, records: list[dict]) -> tuple[int, int]:
    """Horovod's cross rank/size: this rank's index among the ranks with its local rank."""
    if world.cross_rank is not None and world.cross_size is not None:
        return world.cross_rank, world.cross_size
    peers = [r for r, rec in enumerate(records) if rec["local_rank"] == world.local_rank]
    return peers.index(world.rank), len(peers)


_LOG_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
               "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def _configure_logging(env: Mapping[str, str], rank: int) -> None:
    """Honour GPUCOMM_LOG_LEVEL / HOROVOD_LOG_LEVEL (gpucomm-run --log-level; --verbose means INFO)
    with a stderr handler whose lines carry this process's rank."""
    for name in ("GPUCOMM_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        value = env.get(name, "").strip().upper()
        if not value:
            continue
        if value not in _LOG_LEVELS:
            raise ValueError(f"{name}={value!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}")
        log.setLevel(_LOG_LEVELS[value])
        handler = next((h for h in log.handlers if getattr(h, "_gpucomm", False)), None)
        if handler is None:
            handler = logging.StreamHandler()
            handler._gpucomm = True  # type: ignore[attr-defined]
            log.addHandler(handler)
        handler.setFormatter(logging.Formatter(f"gpucomm rank {rank} %(levelname)s %(name)s: %(message)s"))
        return
    if not log.handlers and not logging.getLogger().handlers:  # warnings (stalls) still reach the user
        handler = logging.StreamHandler()
        handler._gpucomm = True  # type: ignore[attr-defined]
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(f"gpucomm rank {rank} %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


class _Steps:
    """Times the set-up steps of ``init`` for the log (gpucomm-run --verbose shows them)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        log.info("init: %s in %.3f s (%.3f s since init began)", what, now - self.last, now - self.start)
        self.last = now


def _static_sets(process_sets, size: int, env: Mapping[str, str]) -> tuple[list[tuple[int, ...]], bool]:
    """The sets to register at init, and whether ``add_process_set`` is allowed later."""
    dynamic = env_flag(env, ("GPUCOMM_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS"))
    if process_sets is None:
        return [], dynamic
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet (or rank lists), or "
                             f"the string 'dynamic'.")
        return [], True
    out: list[tuple[int, ...]] = []
    for ps in process_sets:
        ranks = tuple(sorted(getattr(ps, "ranks", ps)))
        check_members(ranks, size, "init(process_sets=...)")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"init(process_sets=...): the set {list(ranks)} lists a rank twice.")
        if ranks == tuple(range(size)) or ranks in out:
            raise ValueError(f"init(process_sets=...): the set {list(ranks)} is registered twice (the set of all "
                             f"ranks is always there as hvd.global_process_set).")
        out.append(ranks)
    return out, dynamic


def _connect_control(client: RendezvousClient, prefix: str, world: World, secret: bytes, one_host: bool,
                     iface: str | None, start_timeout: float) -> tuple:
    """Connect every rank to rank 0's coordinator: (channel to rank 0 or None, rank 0's channels)."""
    if world.size == 1:
        return None, {}
    key = f"{prefix}control"
    if world.rank == 0:
        listener = ControlListener(secret, "127.0.0.1" if one_host else "0.0.0.0")
        host = "127.0.0.1" if one_host else (_interface_address(iface) if iface else
                                             address_towards(world.rendezvous_addr or "8.8.8.8"))
        client.set(key, json.dumps({"host": host, "port": listener.port}).encode())
        return None, listener.accept(list(range(1, world.size)), start_timeout)
    where = json.loads(client.get(key, start_timeout))
    return connect_control(where["host"], where["port"], secret, world.rank, start_timeout), {}


def _gloo_iface(env: Mapping[str, str]) -> str | None:
    return env.get("GPUCOMM_GLOO_IFACE") or env.get("HOROVOD_GLOO_IFACE")


def _gloo(client: RendezvousClient, prefix: str, rank: int, size: int, timeout: float, hosts: list[str],
          iface: str | None) -> GlooBackend:
    """A Gloo group on the store under ``prefix``: on loopback when every rank is on one host, else
    on ``iface`` (or the default route's interface)."""
    one_host = len(set(hosts)) == 1
    return GlooBackend(client, prefix, rank, size, timeout=timeout,
                       hostname="127.0.0.1" if one_host and not iface else None, interface=iface)


def _interface_address(iface: str) -> str:
    address = interface_ipv4(iface)
    if address is None:
        raise GpucommError(f"GPUCOMM_GLOO_IFACE={iface!r} names no interface with an IPv4 address on this host.")
    return address


def _build(env: Mapping[str, str], gen: int, process_sets=None) -> Runtime:
    world = detect_world(env)
    _configure_logging(env, world.rank)
    steps = _Steps()
    static_sets, dynamic_sets = _static_sets(process_sets, world.size, env)
    control = ControlConfig.from_env(env, env_seconds(env, ("GPUCOMM_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
                                                      DEFAULT_TIMEOUT))
    timeout = control.timeout
    start_timeout = env_seconds(env, ("GPUCOMM_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), DEFAULT_START_TIMEOUT)
    t0 = time.monotonic()
    server, client = _open_store(world, gen, start_timeout, timeout)
    steps.done(f"rendezvous store at {client.host}:{client.port} reached (launcher: {world.launcher})")
    prefix = f"{world.run_id}/g{gen}/"
    try:
        record: dict[str, Any] = {"host": world.hostname, "local_rank": world.local_rank, "pid": os.getpid()}
        single_gpu = devices.single_gpu_test_enabled(env)
        pinned = None
        try:
            if single_gpu:
                devices.apply_single_gpu_test_env(world.rank, os.environ)
            pinned = devices.pin_local_gpu(world.local_rank, world.local_size, single_gpu_test=single_gpu,
                                           hostname=world.hostname)
            record["bus_id"] = pinned.gpu.pci_bus_id if pinned else None
        except Exception as e:  # tell the other ranks before failing here
            record["error"] = f"{type(e).__name__}: {e}"
            client.set(f"{prefix}arrive/{world.rank}", json.dumps(record).encode())
            if server is not None:  # keep serving until the others have read why
                try:
                    wait_for_ranks(client, f"{prefix}arrive", range(world.size), min(start_timeout, SHUTDOWN_GRACE), "init")
                    time.sleep(0.5)
                except RendezvousError:
                    pass
            raise
        steps.done(f"device chosen: {pinned or 'CPU'}")
        records = _arrive(client, prefix, world, record, start_timeout)
        steps.done(f"all {world.size} ranks arrived")
        gpus = [(r, rec["host"], rec["bus_id"]) for r, rec in enumerate(records) if rec.get("bus_id")]
        devices.check_unique_assignment(gpus, single_gpu_test=single_gpu)
        cross_rank, cross_size = _cross(world, records)
        hosts = [rec["host"] for rec in records]
        one_host = len(set(hosts)) == 1
        iface = _gloo_iface(env)
        gloo = _gloo(client, f"{prefix}gloo/", world.rank, world.size, timeout, hosts, iface)
        steps.done("Gloo group ready")
        try:
            links = _connect_control(client, prefix, world, client.secret, one_host, iface, start_timeout)
            steps.done("control plane connected" if world.size > 1 else "control plane ready (one rank)")
        except BaseException:
            gloo.close()
            raise
    except BaseException:
        client.close()
        if server is not None:
            server.close()
        raise
    log.info("init: rank %d of %d ready in %.2f s (device %s)", world.rank, world.size, time.monotonic() - t0, pinned or "CPU")
    return Runtime(world, client, server, prefix, timeout, gloo, pinned, hosts, cross_rank, cross_size, control,
                   links, static_sets, dynamic_sets)


__all__ = ["Runtime", "current", "init", "is_initialized", "shutdown"]
