"""How the ranks of a job meet: where the rendezvous store is (served by rank 0, the launcher, or
published through torchrun's store), every rank's arrival record, and Horovod's cross rank and size.
The store itself, its server and client, is ``rendezvous.py``: "rendezvous" names the store, as in
``GPUCOMM_RENDEZVOUS_ADDR``/``_PORT``; "arrival" names a rank's meeting the others there.

Trust at the edges: a store keyed with a derived secret (MPI, Slurm, manual launches without
``GPUCOMM_SECRET``) is announced once on rank 0, or refused with ``GPUCOMM_REQUIRE_SECRET=1``;
rank 0's store listens only on the address the ranks are told; a rank is claimed at the store by
exactly one process (``claim_arrival``), and a second claimant fails itself and, through the
``{prefix}conflict`` key that rank 0 watches (``watch_conflicts``), the whole job, naming both.

Pure bootstrap: nothing here knows about collectives; ``gpucomm.job`` builds the job on top.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Callable

from ..errors import GpucommError, RendezvousUnreachable
from ..settings import DEFAULT_LIVENESS_S, RENDEZVOUS_BIND, REQUIRE_SECRET
from .key_exchange import KeyPair, SealError, seal, unseal
from .netaddr import address_for_peers, address_towards, host_port, is_ipv6, unbracket
from .rendezvous import RendezvousClient, RendezvousError, RendezvousServer, RendezvousTimeout, wait_for_ranks
from .world import GPUCOMM_SECRET, World

log = logging.getLogger("gpucomm.bootstrap")

REQUIRE_SECRET_VAR = REQUIRE_SECRET.names[0]
BIND_VAR = RENDEZVOUS_BIND.names[0]
CONFLICT_WATCH_SECONDS = 10.0  # rank 0 re-asks the store for a conflict this often (one request, no traffic)
_SECRET_HOW = (f"export {GPUCOMM_SECRET}=$(python3 -c 'import secrets; print(secrets.token_hex(32))') and pass "
               f"it to every rank (mpirun -x {GPUCOMM_SECRET}, srun --export=ALL; launch/mpirun.sh and "
               f"launch/slurm.sbatch do this)")
_warned_derived = False


def torch_store_rendezvous(world: World, gen: int, start_timeout: float):
    """Under torchrun: rank 0 serves our store on a free port and publishes where through
    torchrun's own TCPStore at MASTER_ADDR:MASTER_PORT. That store is unauthenticated, so the job
    secret is never put there: ranks share ``GPUCOMM_SECRET`` from their environment, or rank 0
    hands a fresh one to each rank sealed under a Diffie-Hellman key (``key_exchange.py``)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = _open_torch_store(world, agent_store, start_timeout)
    # a restarted torchrun keeps its run id and store: the restart count keeps attempts apart
    base = f"gpucomm/{world.run_id}/r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/g{gen}"
    server = None
    if world.rank == 0:
        secret = world.secret or secrets.token_bytes(32)
        host = address_towards(world.rendezvous_addr, world.rendezvous_port) if world.local_size == world.size \
            else address_for_peers(world.rendezvous_addr, world.rendezvous_port)  # (not loopback: see there)
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
                    if not agent_store:  # the store dies with this process: let the others read the error first
                        try:
                            _wait_until_read(store, base, world.size, start_timeout)
                        except RuntimeError:  # a rank that never came: the error below says what went wrong
                            pass
                    raise GpucommError(_secret_mismatch(f"rank {r} has GPUCOMM_SECRET set and rank 0 does not"))
                store.set(f"{base}/sealed/{r}", seal(secret, mine.shared_key(theirs, _context(base, r))))
        store.set(f"{base}/rendezvous", json.dumps(info))
        if not agent_store and world.size > 1:
            # an older torchrun (seen: torch 2.1) leaves the store to rank 0 (TORCHELASTIC_USE_AGENT_STORE=False):
            # it lives in this process and ends with ``store``, so wait until every rank has read it
            try:
                _wait_until_read(store, base, world.size, start_timeout)
            except RuntimeError as e:
                server.close()
                raise GpucommError(f"rank 0 serves torchrun's store (this torch's torchrun does not), and not every "
                                   f"rank read the job's rendezvous from it within {start_timeout:g} s ({e}); "
                                   f"check that all ranks started (GPUCOMM_START_TIMEOUT)") from None
        return server, host, server.port, secret
    try:
        return _read_torch_store_rendezvous(world, store, base)
    except GpucommError:
        raise
    except RuntimeError as e:  # torch's store errors: the store went away, or rank 0 never published
        raise GpucommError(_unreadable(world, agent_store, start_timeout, e)) from None
    finally:
        try:
            store.set(f"{base}/read/{world.rank}", "1")  # rank 0 may stop serving the store now
        except RuntimeError:  # the store is gone: the read above has already said why
            pass


def _open_torch_store(world: World, agent_store: bool, start_timeout: float):
    """torchrun's TCPStore at MASTER_ADDR:MASTER_PORT: served by rank 0's process when torchrun's
    agent keeps none (torch < 2.4), otherwise by the agent. An older torchrun picks MASTER_PORT free,
    closes it and hands it over, so another process can take it before rank 0 binds it: rank 0
    waits for it to come free and the others, meanwhile finding nothing or a stranger there, retry,
    all within ``start_timeout``; then the error names the port's holder's race and its fixes."""
    import datetime

    import torch.distributed as dist

    serve = world.rank == 0 and not agent_store
    deadline = time.monotonic() + start_timeout
    while True:
        left = math.ceil(max(deadline - time.monotonic(), 1.0))  # torch 2.1 truncates a timeout to whole seconds
        try:
            store = dist.TCPStore(world.rendezvous_addr, world.rendezvous_port, world.size, is_master=serve,
                                  timeout=datetime.timedelta(seconds=left), wait_for_workers=False)
            if not serve:  # one round trip: torch 2.1's client connects without one, so a stranger shows here
                store.num_keys()
            return store
        except (RuntimeError, TimeoutError) as e:  # torch's store errors (Dist*Error derive from RuntimeError)
            if serve and not _address_in_use(str(e)):
                raise
            if time.monotonic() + STORE_RETRY_S >= deadline:
                if serve:
                    raise GpucommError(_port_taken(world, start_timeout)) from None
                raise GpucommError(_unreadable(world, agent_store, start_timeout, e)) from None
            time.sleep(STORE_RETRY_S)


STORE_RETRY_S = 0.25  # a rank retrying torchrun's store: often enough to start within a second of it coming free


def _unreadable(world: World, agent_store: bool, start_timeout: float, error: Exception) -> str:
    where = "rank 0's process" if not agent_store else "torchrun's agent"
    return (f"rank {world.rank} could not read the job's rendezvous from torchrun's store at "
            f"{host_port(world.rendezvous_addr, world.rendezvous_port)} ({error}). That store is served by {where}; likely "
            f"causes: rank 0 failed or ended before this rank read it, or did not start within {start_timeout:g} s "
            f"(GPUCOMM_START_TIMEOUT). Rank 0's error, if it failed, is in {_RANK0_OUTPUT['torchrun']}.")


def _address_in_use(message: str) -> bool:
    """torch's bind failure, worded "Address already in use (errno: 98)" by torch 2.1 and "code: -98, name:
    EADDRINUSE, message: address already in use" by later ones."""
    return "address already in use" in message.lower() or "EADDRINUSE" in message


def _port_taken(world: World, start_timeout: float) -> str:
    where = f"{host_port(world.rendezvous_addr, world.rendezvous_port)}"
    return (f"rank 0 must serve torchrun's store at {where} (this torch's torchrun keeps no store of its own: "
            f"TORCHELASTIC_USE_AGENT_STORE is not true), and another process held port {world.rendezvous_port} "
            f"for the whole {start_timeout:g} s start timeout. Cause: this torchrun (torch < 2.4 with --standalone "
            f"or --rdzv-backend c10d) picks MASTER_PORT free, closes it and hands it to rank 0, and another process "
            f"bound it in between. Fix: use torch >= 2.4, whose torchrun serves the store itself; or give torchrun "
            f"a port it serves itself from the start (static rendezvous: drop --standalone and --rdzv-backend, pass "
            f"--master-addr <rank 0's host> --master-port <a port no other job uses>, and --node-rank on several "
            f"nodes); GPUCOMM_START_TIMEOUT makes rank 0 wait longer for the port.")


def _wait_until_read(store, base: str, size: int, timeout: float) -> None:
    """Rank 0, serving torchrun's store itself (torch 2.1's torchrun): block until every other rank
    has read the rendezvous key, so that the store does not end with this process before they have.
    Raises ``RuntimeError`` (torch's) after ``timeout`` seconds."""
    import datetime

    store.wait([f"{base}/read/{r}" for r in range(1, size)], datetime.timedelta(seconds=timeout))


def _read_torch_store_rendezvous(world: World, store, base: str):
    """A rank other than 0: where rank 0's store is, and the job secret, from torchrun's store."""
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


def bind_address(addr: str, all_local: bool, override: str | None = None) -> str:
    """Where rank 0's store listens: the address the ranks are told (``addr``), resolved on this
    host. A loopback address (or, when every rank runs on this host, a name resolving to one) is
    bound as such; any other must be an address of this host. ``override`` (GPUCOMM_RENDEZVOUS_BIND)
    wins, ``0.0.0.0`` and ``::`` included. An IPv4 address of a name is preferred to its IPv6 one, as
    ``address_towards`` prefers it. Raises ``GpucommError`` when ``addr`` cannot be bound here."""
    if override:
        _check_bind_family(addr, override)
        return override
    try:
        infos = sorted(socket.getaddrinfo(unbracket(addr), None, type=socket.SOCK_STREAM),
                       key=lambda info: info[0] != socket.AF_INET)
        ip = infos[0][4][0].split("%", 1)[0]
    except (OSError, UnicodeError, IndexError) as e:
        raise GpucommError(f"rank 0 cannot resolve the rendezvous address {addr!r} ({e}), so it cannot serve the "
                           f"store on it. Set GPUCOMM_RENDEZVOUS_ADDR to an address of rank 0's host that every "
                           f"rank can reach.") from None
    if is_ipv6(ip) and ipaddress.ip_address(ip).is_link_local:
        raise GpucommError(f"the rendezvous address {addr!r} is IPv6 link-local ({ip}): it is only meaningful together "
                           f"with an interface name, which differs between hosts, so rank 0 does not serve the "
                           f"store there. Set GPUCOMM_RENDEZVOUS_ADDR to a global (or unique-local, fd00::/8) "
                           f"address of rank 0's host.")
    if ipaddress.ip_address(ip).is_loopback:
        if all_local:
            return ip
        if unbracket(addr) == ip or addr == "localhost":
            raise GpucommError(
                f"the rendezvous address is {addr!r}, a loopback address, but this job has ranks on other hosts: "
                f"there it names their own host, so they would wait for a store that is not there until "
                f"GPUCOMM_START_TIMEOUT. Likely cause: a host list written with localhost for this host (e.g. "
                f"localhost:4,node2:4). Fix: set GPUCOMM_RENDEZVOUS_ADDR to this host's address on the network the "
                f"ranks share, or name this host by a name the others resolve (where the hosts really share this "
                f"network namespace, as containers on host networking do, {BIND_VAR}={addr} keeps it).")
        raise GpucommError(
            f"the rendezvous address {addr!r} resolves to {ip} (loopback) on rank 0's host, but this job has ranks "
            f"on other hosts, which reach rank 0 under an address this host does not know; rank 0 serves the store "
            f"only on the address it is told. Likely cause: /etc/hosts maps this host's name to 127.0.1.1 "
            f"(Debian's default). Fix: set GPUCOMM_RENDEZVOUS_ADDR to rank 0's IP address on the network the ranks "
            f"share, or {BIND_VAR}=:: to listen on every interface (0.0.0.0: every IPv4 one).")
    try:
        with socket.socket(socket.AF_INET6 if is_ipv6(ip) else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError as e:
        raise GpucommError(
            f"the rendezvous address {addr!r} ({ip}) is not an address of rank 0's host ({e}), and rank 0 serves the "
            f"store only on the address the ranks are told. Likely causes: rank 0 was placed on another host than "
            f"GPUCOMM_RENDEZVOUS_ADDR names, or the address is translated (NAT, a container or service address). "
            f"Fix: point GPUCOMM_RENDEZVOUS_ADDR at rank 0's host, or set {BIND_VAR} to the local address to listen "
            f"on (:: or 0.0.0.0: every interface).") from None
    return ip


def _check_bind_family(addr: str, override: str) -> None:
    """Refuse a GPUCOMM_RENDEZVOUS_BIND of one family for a rendezvous address of the other alone: the store would
    listen where no rank connects (each, rank 0 too, waited out the start timeout: helper-69). ``::`` serves both."""
    try:
        families = {info[0] for info in socket.getaddrinfo(unbracket(addr), None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return  # (the ranks' own connection error says it)
    bind = unbracket(override)
    if bind == "::":
        return
    want = socket.AF_INET6 if is_ipv6(bind) else socket.AF_INET
    if want not in families:
        have, other = ("IPv6", "IPv4") if want == socket.AF_INET else ("IPv4", "IPv6")
        raise GpucommError(f"{BIND_VAR}={override} listens on {other} only, but the rendezvous address {addr!r} is "
                           f"reached over {have} alone, so no rank could reach the store. Set {BIND_VAR}=:: (every "
                           f"interface of both families), or an {have} address of this host.")


def check_secret(world: World, require: bool) -> None:
    """A derived secret (no GPUCOMM_SECRET under MPI, Slurm or a manual launch) can be computed by
    anyone who can reach the store: warn once on rank 0, or raise on every rank when ``require``."""
    global _warned_derived
    if world.secret_source != "derived":
        return
    where = f"{host_port(world.rendezvous_addr, world.rendezvous_port)}"
    if require:
        raise GpucommError(
            f"{REQUIRE_SECRET_VAR}=1 but {GPUCOMM_SECRET} is not set: this {world.launcher} job's store at {where} "
            f"would authenticate with a key derived from the job id, address and port, which any process that can "
            f"reach {where} can compute. Fix: {_SECRET_HOW}.")
    if world.rank == 0 and not _warned_derived:
        _warned_derived = True
        log.warning("no %s is set: this %s job's rendezvous store at %s accepts any process that can reach %s "
                    "(its key is derived from the job id, address and port, which anyone can compute). To "
                    "authenticate the ranks, %s. %s=1 turns this warning into an error.",
                    GPUCOMM_SECRET, world.launcher, where, where, _SECRET_HOW, REQUIRE_SECRET_VAR)


_FROM_ENV = "env"  # published instead of a public value by a rank whose secret comes from GPUCOMM_SECRET


def _secret_mismatch(what: str) -> str:
    return f"{what}. Export the same GPUCOMM_SECRET to every rank, or to none (then rank 0 makes one)."


def _context(base: str, rank: int) -> bytes:
    return f"{base}/rank{rank}".encode()


def open_store(world: World, gen: int, start_timeout: float, timeout: float, *, prefix: str = "",
               record: dict | None = None, require_secret: bool = False, bind: str | None = None,
               dead_peer_after: float | None = DEFAULT_LIVENESS_S):
    """Start (rank 0) and connect to the rendezvous store; returns (server, client).

    ``require_secret``: refuse a derived secret (``check_secret``); ``bind``: where rank 0's store
    listens instead of the address the ranks are told; ``dead_peer_after``: a store host (or a
    rank's) that acknowledges nothing for that long is given up (``keepalive.py``). A rank 0 that finds the port held by a store
    of this very job (same secret) is a second rank 0: with ``prefix`` and ``record`` it claims rank
    0 there, which fails it and the job naming both processes."""
    if world.launcher == "none":
        secret = secrets.token_bytes(32)
        server = RendezvousServer(secret, "127.0.0.1", 0)
        return server, RendezvousClient("127.0.0.1", server.port, secret, connect_timeout=start_timeout, timeout=timeout,
                                        dead_peer_after=dead_peer_after)
    check_secret(world, require_secret)
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
            listen = bind_address(host, world.local_size == world.size, bind)
            try:
                server = RendezvousServer(secret, listen, port, dead_peer_after=dead_peer_after)
            except OSError as e:
                if e.errno == errno.EADDRINUSE and prefix and record is not None:
                    _second_root(world, host, port, secret, prefix, record, start_timeout)
                same = (f" This {world.launcher} launch gave no job id, so every job launched so on this host "
                        f"derives this port: set GPUCOMM_RUN_ID to a value of its own for each job.") \
                    if not world.run_id else ""
                if e.errno != errno.EADDRINUSE:
                    raise GpucommError(
                        f"rank 0 could not serve the rendezvous store on {host_port(listen, port)}: {e}. Set "
                        f"{BIND_VAR} to an address of this host to listen on (::, every interface), or "
                        f"GPUCOMM_RENDEZVOUS_ADDR to one the other ranks reach it on.") from e
                raise GpucommError(
                    f"rank 0 could not serve the rendezvous store on {host_port(listen, port)}: {e}. Another process "
                    f"holds the port (perhaps an earlier job still running); set GPUCOMM_RENDEZVOUS_PORT to a free "
                    f"port on every rank.{same}") from e
    if server is not None and prefix:
        server.put(_store_marker(prefix), b"1")
    try:
        if world.rank != 0 and prefix and not world.rendezvous_hosted and not world.port_via_torch_store:
            client = _this_generations_store(host, port, secret, prefix, start_timeout, timeout, dead_peer_after)
        else:
            client = RendezvousClient(host, port, secret, connect_timeout=start_timeout, timeout=timeout,
                                      dead_peer_after=dead_peer_after)
    except RendezvousUnreachable as e:
        if server is not None:
            server.close()
        if world.rank == 0 or world.rendezvous_hosted:
            raise
        raise RendezvousUnreachable(f"{e} {rank0_output_hint(world)}") from None
    except Exception:
        if server is not None:
            server.close()
        raise
    return server, client


# where a launcher shows rank 0's output, by ``World.launcher``
_RANK0_OUTPUT = {
    "gpucomm": "the output of the process started with GPUCOMM_RANK=0",
    "horovod": "the output of the process started with HOROVOD_RANK=0",
    "torchrun": "torchrun's output for rank 0 (torchrun --tee 3 shows it, or its --log-dir)",
    "openmpi": "mpirun's output for rank 0 (mpirun --tag-output labels each line with its rank)",
    "mpich": "mpiexec's output for rank 0 (mpiexec -prepend-rank labels each line with its rank)",
    "slurm": "srun's output for task 0 (srun --label labels each line; under sbatch, the job's output file)",
}


def rank0_output_hint(world: World) -> str:
    """For a rank that cannot reach the store rank 0 serves: rank 0 may have failed at start, and
    where its own output (which says why) is."""
    where = _RANK0_OUTPUT.get(world.launcher, "rank 0's own output")
    hint = (f"In this {world.launcher} launch rank 0 serves the store: if it failed at start (for example on a "
            f"GPUCOMM_*/HOROVOD_* setting it refused, which ranks sharing its environment refuse too, at once), its "
            f"error is in {where}.")
    if world.launcher == "mpich":
        hint += (f" Under MPICH's mpiexec each rank takes the job's id (here {world.run_id or 'none'}) from the "
                 f"mpiexec proxy it runs under; a rank started outside that process tree (a container of its own, "
                 f"a wrapper that detaches it) takes another: set GPUCOMM_RUN_ID to one value for the whole job.")
    return hint


def _store_marker(prefix: str) -> str:
    return f"{prefix}store"


def _this_generations_store(host: str, port: int, secret: bytes, prefix: str, start_timeout: float,
                            timeout: float, dead_peer_after: float | None = DEFAULT_LIVENESS_S) -> RendezvousClient:
    """A client of the store rank 0 serves for this init. After a re-init, rank 0's previous store
    may still answer on the same port for a moment (it serves the last ranks shutting down); a rank
    that reached it waits for it to close and connects again, so its keys land in the new one."""
    deadline = time.monotonic() + start_timeout
    while True:
        client = RendezvousClient(host, port, secret, connect_timeout=max(0.1, deadline - time.monotonic()),
                                  timeout=timeout, dead_peer_after=dead_peer_after)
        try:
            client.wait([_store_marker(prefix)], max(0.0, deadline - time.monotonic()))
            return client
        except RendezvousTimeout:
            client.close()
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(
                    f"the rendezvous store at {host_port(host, port)} did not become this init's store within "
                    f"{start_timeout:.0f} s: a store answers there, but rank 0 never started this init's. Likely "
                    f"causes: rank 0 failed or has not called init() again; another job with the same secret "
                    f"serves that port. Raise GPUCOMM_START_TIMEOUT if rank 0 only starts slowly.",
                    [_store_marker(prefix)]) from None
        except RendezvousError:
            client.close()  # the previous store closed under us: connect to the new one
        time.sleep(0.05)


def _second_root(world: World, host: str, port: int, secret: bytes, prefix: str, record: dict,
                 start_timeout: float) -> None:
    """Rank 0's port is held. If a store of this job (our secret) answers there and its rank 0 has
    arrived, this process is a second rank 0: claim the rank (which raises, naming both). Otherwise
    return (the port belongs to something else)."""
    try:
        client = RendezvousClient(host, port, secret, connect_timeout=min(start_timeout, 5.0), timeout=start_timeout)
    except RendezvousError:
        return
    try:
        client.get(f"{prefix}arrive/0", start_timeout)
        claim_arrival(client, prefix, world, record)
    except RendezvousError:
        return
    finally:
        client.close()


def conflict_key(prefix: str) -> str:
    """The store key a second claimant writes its error to; rank 0 watches it (``watch_conflicts``)."""
    return f"{prefix}conflict"


def duplicate_claim(rank: int, holder: tuple[str, object] | None, claimant: tuple[str, object], peer: object,
                    how: str) -> str:
    """The error for a second process claiming ``rank``: names the rank and both (host, pid);
    ``how`` says where the second claim was made ("arriving at the rendezvous store")."""
    first = f"host {holder[0]} pid {holder[1]}" if holder is not None else "the process connected first"
    where = f" from {host_port(peer[0], peer[1])}" if isinstance(peer, tuple) and len(peer) >= 2 else ""
    return (f"two processes claim rank {rank} of this job: {first} holds it, and host {claimant[0]} pid "
            f"{claimant[1]}{where} claimed it too, {how}. Each rank must be one process. Likely causes: the "
            f"launcher (or a wrapper, or a retry that did not stop the first attempt) started that rank twice, or "
            f"a process holding the job secret is impersonating it. Fix: stop the extra process and start each "
            f"rank exactly once; keep GPUCOMM_SECRET private.")


def _claimant(raw: bytes) -> tuple[str, object] | None:
    try:
        rec = json.loads(raw)
        return str(rec["host"]), rec["pid"]
    except (ValueError, KeyError, TypeError):
        return None


def claim_arrival(client: RendezvousClient, prefix: str, world: World, record: dict) -> None:
    """Publish this rank's arrival record, unless another process holds the rank already: then
    write the error under ``conflict_key(prefix)`` (rank 0 fails the job with it) and raise it."""
    key = f"{prefix}arrive/{world.rank}"
    mine = json.dumps(record).encode()
    held = client.compare_set(key, b"", mine)
    if held == mine:
        return
    me = (world.hostname, os.getpid())
    holder = _claimant(held)
    if holder is not None and str(holder[0]) == me[0] and str(holder[1]) == str(me[1]):
        client.set(key, mine)  # this very process again (a retried step): update its record
        return
    message = duplicate_claim(world.rank, holder, me, None, "arriving at the rendezvous store")
    try:
        client.set(conflict_key(prefix), message.encode())
    except RendezvousError:
        pass  # the store is gone: the job is failing anyway
    raise GpucommError(message)


def watch_conflicts(client: RendezvousClient, prefix: str, on_conflict: Callable[[str], None],
                    on_exit: Callable[[], None] | None = None,
                    on_lost: Callable[[str], None] | None = None) -> threading.Thread:
    """Rank 0: a daemon thread that calls ``on_conflict(message)`` once a second claimant of some
    rank has written ``conflict_key(prefix)``; it ends (calling ``on_exit``) when the client closes.
    Its request is always open at the store, so it also finds a store that went away while the
    client was still in use (the launcher exited, or its host dropped off the network: the client's
    keepalive ends the request): ``on_lost(error)`` then."""
    key = conflict_key(prefix)

    def watch() -> None:
        try:
            while True:
                try:
                    client.wait([key], CONFLICT_WATCH_SECONDS)
                    message = client.get(key, CONFLICT_WATCH_SECONDS).decode(errors="replace")
                    break
                except RendezvousTimeout:
                    continue
                except RendezvousError as e:
                    if on_lost is not None and not client.closed:
                        on_lost(str(e))
                    return  # closed (gpucomm shut down) or the store is gone
            on_conflict(message)
        finally:
            if on_exit is not None:
                on_exit()

    thread = threading.Thread(target=watch, name="gpucomm-claims", daemon=True)
    thread.start()
    return thread


def arrive(client: RendezvousClient, prefix: str, world: World, record: dict, start_timeout: float,
           interrupt: Callable[[], None] | None = None) -> list[dict]:
    """Claim this rank and read everyone's records; a rank that failed before arriving (its record
    carries ``error``) makes every rank fail with that rank's message. ``interrupt`` (elastic
    rounds) is asked every 0.5 s while waiting and may raise to stop the wait."""
    claim_arrival(client, prefix, world, record)
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


__all__ = ["BIND_VAR", "REQUIRE_SECRET_VAR", "arrive", "bind_address", "check_secret", "claim_arrival", "conflict_key",
           "cross_placement", "duplicate_claim", "open_store", "rank0_output_hint", "torch_store_rendezvous",
           "watch_conflicts"]
