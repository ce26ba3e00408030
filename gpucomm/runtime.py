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
from typing import Any, Mapping

import torch

from . import devices, failures
from .backends.gloo import GlooBackend
from .engine import Engine, Handle
from .errors import GpucommError, NotInitializedError
from .ops import Executor, Request
from .rendezvous import RendezvousClient, RendezvousError, RendezvousServer, address_towards, wait_for_ranks
from .world import World, detect_world

log = logging.getLogger("gpucomm")

DEFAULT_TIMEOUT = 300.0  # seconds a collective may take before it is declared failed
DEFAULT_START_TIMEOUT = 120.0  # seconds all ranks have to reach init()
SHUTDOWN_GRACE = 10.0  # rank 0 keeps serving the store this long for ranks still shutting down


def env_seconds(env: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    """The first of ``names`` set in ``env`` as a positive number of seconds, else ``default``."""
    for name in names:
        value = env.get(name)
        if value:
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number of seconds") from None
            if seconds <= 0:
                raise ValueError(f"{name}={value!r} must be positive")
            return seconds
    return default


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
    engine: Engine = field(init=False)
    _nccl: Any = None
    _nccl_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        executor = Executor(self.world.rank, self.world.size, self.gloo, self.nccl, timeout=self.timeout)
        self.engine = Engine(executor, self.timeout)

    def nccl(self):
        """The NCCL backend, created on first use by the first CUDA collective (the same call on
        every rank, since every rank issues collectives in the same order)."""
        with self._nccl_lock:
            if self._nccl is None:
                from .backends.nccl import NcclBackend, nccl_module  # noqa: PLC0415

                nccl = nccl_module()
                if nccl is None:
                    raise GpucommError(
                        "a collective on a CUDA tensor needs NCCL, but CuPy's NCCL bindings could not be loaded. "
                        "Install the extra that matches your CUDA: pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]'.")
                key = f"{self.prefix}nccl/uid"
                if self.world.rank == 0:
                    self.client.set(key, bytes(nccl.get_unique_id()))
                uid = self.client.get(key, self.timeout)
                ordinal = self.device.cuda_ordinal if self.device is not None else torch.cuda.current_device()
                self._nccl = NcclBackend(uid, self.world.rank, self.world.size, ordinal)
            return self._nccl

    def submit(self, request: Request) -> Handle:
        if request.device.type == "cuda":
            request.ready_event = torch.cuda.Event()
            request.ready_event.record(torch.cuda.current_stream(request.device))
        return self.engine.submit(request, inline=not request.needs_exchange)

    def close(self) -> None:
        self.engine.shutdown()
        if self._nccl is not None:
            self._nccl.close()
        self.gloo.close()
        try:
            self.client.add(f"{self.prefix}shutdown", 1)
            if self.server is not None:
                self._wait_for_others_to_leave()
        except RendezvousError as e:
            log.debug("shutdown: store already gone: %s", e)
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


def init() -> Runtime:
    """Join the job described by the environment; idempotent while initialized."""
    global _runtime, _generation
    with _lock:
        if _runtime is not None:
            return _runtime
        _generation += 1
        rt = _runtime = _build(os.environ, _generation)
        failures.set_reporter(lambda exc: failures.record_failure(
            rt.client, rt.world.run_id, rt.world.rank, rt.world.hostname, failures.summarize(exc)))
        return rt


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


def _configure_logging(env: Mapping[str, str]) -> None:
    """Honour GPUCOMM_LOG_LEVEL / HOROVOD_LOG_LEVEL (gpucomm-run --log-level) with a stderr handler."""
    for name in ("GPUCOMM_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        value = env.get(name, "").strip().upper()
        if not value:
            continue
        if value not in _LOG_LEVELS:
            raise ValueError(f"{name}={value!r} is not a log level; use one of {', '.join(_LOG_LEVELS)}")
        log.setLevel(_LOG_LEVELS[value])
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("gpucomm %(levelname)s: %(message)s"))
            log.addHandler(handler)
        return


def _build(env: Mapping[str, str], gen: int) -> Runtime:
    _configure_logging(env)
    world = detect_world(env)
    timeout = env_seconds(env, ("GPUCOMM_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"), DEFAULT_TIMEOUT)
    start_timeout = env_seconds(env, ("GPUCOMM_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), DEFAULT_START_TIMEOUT)
    t0 = time.monotonic()
    server, client = _open_store(world, gen, start_timeout, timeout)
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
        records = _arrive(client, prefix, world, record, start_timeout)
        gpus = [(r, rec["host"], rec["bus_id"]) for r, rec in enumerate(records) if rec.get("bus_id")]
        devices.check_unique_assignment(gpus, single_gpu_test=single_gpu)
        cross_rank, cross_size = _cross(world, records)
        hosts = [rec["host"] for rec in records]
        one_host = len(set(hosts)) == 1
        iface = env.get("GPUCOMM_GLOO_IFACE") or env.get("HOROVOD_GLOO_IFACE")
        gloo = GlooBackend(client, f"{prefix}gloo/", world.rank, world.size, timeout=timeout,
                           hostname="127.0.0.1" if one_host and not iface else None, interface=iface)
    except BaseException:
        client.close()
        if server is not None:
            server.close()
        raise
    log.debug("rank %d/%d initialized in %.2f s (device %s)", world.rank, world.size, time.monotonic() - t0, pinned)
    return Runtime(world, client, server, prefix, timeout, gloo, pinned, hosts, cross_rank, cross_size)


__all__ = ["Runtime", "current", "init", "is_initialized", "shutdown"]
