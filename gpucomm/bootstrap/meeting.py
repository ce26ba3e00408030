"""How the ranks of a job meet: the rendezvous store (served by rank 0, the launcher, or published
through torchrun's store), every rank's arrival record, and Horovod's cross rank and size.

Pure bootstrap: nothing here knows about collectives; ``gpucomm.job`` builds the job on top.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from typing import Callable

from ..errors import GpucommError
from .key_exchange import KeyPair, SealError, seal, unseal
from .netaddr import address_towards
from .rendezvous import RendezvousClient, RendezvousServer, wait_for_ranks
from .world import World


def torch_store_rendezvous(world: World, gen: int, start_timeout: float):
    """Under torchrun: rank 0 serves our store on a free port and publishes where through
    torchrun's own TCPStore at MASTER_ADDR:MASTER_PORT. That store is unauthenticated, so the job
    secret is never put there: ranks share ``GPUCOMM_SECRET`` from their environment, or rank 0
    hands a fresh one to each rank sealed under a Diffie-Hellman key (``key_exchange.py``)."""
    import datetime

    import torch.distributed as dist

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(world.rendezvous_addr, world.rendezvous_port, world.size,
                          is_master=(world.rank == 0 and not agent_store),
                          timeout=datetime.timedelta(seconds=start_timeout), wait_for_workers=False)
    # a restarted torchrun keeps its run id and store: the restart count keeps attempts apart
    base = f"gpucomm/{world.run_id}/r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/g{gen}"
    server = None
    if world.rank == 0:
        secret = world.secret or secrets.token_bytes(32)
        host = address_towards(world.rendezvous_addr, world.rendezvous_port)
        server = RendezvousServer(secret, host, 0)  # only the interface the other ranks reach us on
        info = {"host": host, "port": server.port}
        if world.secret is None:
            mine = KeyPair()
            info["public"] = mine.public_hex()
            for r in range(1, world.size):  # each rank's sealed copy, under the key only it and we derive
                theirs = store.get(f"{base}/public/{r}").decode()
                if theirs == _FROM_ENV:
                    store.set(f"{base}/rendezvous", json.dumps({"error": f"rank {r} has GPUCOMM_SECRET set"}))
                    server.close()
                    raise GpucommError(_secret_mismatch(f"rank {r} has GPUCOMM_SECRET set and rank 0 does not"))
                store.set(f"{base}/sealed/{r}", seal(secret, mine.shared_key(theirs, _context(base, r))))
        store.set(f"{base}/rendezvous", json.dumps(info))
        return server, host, server.port, secret
    mine = KeyPair() if world.secret is None else None
    store.set(f"{base}/public/{world.rank}", mine.public_hex() if mine is not None else _FROM_ENV)
    info = json.loads(store.get(f"{base}/rendezvous"))
    if "error" in info:
        raise GpucommError(_secret_mismatch(f"{info['error']} and rank 0 does not"))
    if mine is None:
        if "public" in info:
            raise GpucommError(_secret_mismatch("this rank has GPUCOMM_SECRET set and rank 0 does not"))
        return None, info["host"], info["port"], world.secret
    if "public" not in info:
        raise GpucommError(_secret_mismatch("rank 0 has GPUCOMM_SECRET set and this rank does not"))
    try:
        secret = unseal(store.get(f"{base}/sealed/{world.rank}").decode(),
                        mine.shared_key(info["public"], _context(base, world.rank)))
    except SealError as e:
        raise GpucommError(f"could not receive the job secret from rank 0 through torchrun's store: {e}. Another "
                           f"process may be writing to MASTER_ADDR:MASTER_PORT; export the same GPUCOMM_SECRET to "
                           f"every rank to avoid the exchange.") from None
    return None, info["host"], info["port"], secret


def _bind_address(addr: str) -> str:
    """Where rank 0's store listens: the local address ``addr`` (GPUCOMM_RENDEZVOUS_ADDR /
    MASTER_ADDR) resolves to, so the store is not reachable on other interfaces. A loopback
    resolution (a hostname mapped to 127.0.1.1) says nothing about what other hosts use, and an
    address not on this host cannot be bound: both keep the wildcard."""
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return "0.0.0.0"
    if ip.startswith("127."):
        return "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return "0.0.0.0"
    return ip


_FROM_ENV = "env"  # published instead of a public value by a rank whose secret comes from GPUCOMM_SECRET


def _secret_mismatch(what: str) -> str:
    return f"{what}. Export the same GPUCOMM_SECRET to every rank, or to none (then rank 0 makes one)."


def _context(base: str, rank: int) -> bytes:
    return f"{base}/rank{rank}".encode()


def open_store(world: World, gen: int, start_timeout: float, timeout: float):
    """Start (rank 0) and connect to the rendezvous store; returns (server, client)."""
    if world.launcher == "none":
        secret = secrets.token_bytes(32)
        server = RendezvousServer(secret, "127.0.0.1", 0)
        return server, RendezvousClient("127.0.0.1", server.port, secret, connect_timeout=start_timeout, timeout=timeout)
    if world.port_via_torch_store:
        server, host, port, secret = torch_store_rendezvous(world, gen, start_timeout)
    else:
        host, port = world.rendezvous_addr, world.rendezvous_port
        secret = world.secret or secrets.token_bytes(32)
        if world.secret is None and world.size > 1:
            raise GpucommError(f"the {world.launcher} launcher gave no job secret; set GPUCOMM_SECRET to the same "
                               f"random hex string (32+ characters) on every rank.")
        server = None
        if world.rank == 0 and not world.rendezvous_hosted:
            try:
                server = RendezvousServer(secret, _bind_address(host), port)
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


def arrive(client: RendezvousClient, prefix: str, world: World, record: dict, start_timeout: float,
           interrupt: Callable[[], None] | None = None) -> list[dict]:
    """Publish this rank's record and read everyone's; a rank that failed before arriving (its
    record carries ``error``) makes every rank fail with that rank's message. ``interrupt``
    (elastic rounds) is asked every 0.5 s while waiting and may raise to stop the wait."""
    client.set(f"{prefix}arrive/{world.rank}", json.dumps(record).encode())
    wait_for_ranks(client, f"{prefix}arrive", range(world.size), start_timeout, "gpucomm.init()", interrupt)
    records = [json.loads(client.get(f"{prefix}arrive/{r}")) for r in range(world.size)]
    for r, rec in enumerate(records):
        if rec.get("error"):
            raise GpucommError(f"rank {r} failed in gpucomm.init(): {rec['error']}")
    return records


def cross_placement(world: World, records: list[dict]) -> tuple[int, int]:
    """Horovod's cross rank/size: this rank's index among the ranks with its local rank."""
    if world.cross_rank is not None and world.cross_size is not None:
        return world.cross_rank, world.cross_size
    peers = [r for r, rec in enumerate(records) if rec["local_rank"] == world.local_rank]
    return peers.index(world.rank), len(peers)


__all__ = ["arrive", "cross_placement", "open_store", "torch_store_rendezvous"]
