"""How each rank is started: directly on this host, or through ssh and the remote wrapper elsewhere."""

from __future__ import annotations

import functools
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..bootstrap.netaddr import resolves_here, unbracket
from ..bootstrap.placement import Placement
from .remote import SERVER_ALIVE_COUNT, SERVER_ALIVE_S, encode_request
from .supervisor import Launch
from .worker_env import forwarded_env, worker_env

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def split_user(host: str) -> tuple[str | None, str]:
    """``user@node`` → (``user``, ``node``); ``node`` → (None, ``node``)."""
    user, sep, name = host.rpartition("@")
    return (user, name) if sep else (None, host)


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback name or address, this host's name, or a name
    or address that resolves to one of this host's interfaces (so ``-H 10.0.0.5:2`` run on 10.0.0.5
    starts those ranks directly, as Horovod does; every other address is reached through ssh). A
    host written ``user@host`` always goes through ssh: naming a login is asking for one."""
    user, name = split_user(host)
    if user is not None:
        return False
    return (name in LOCAL_NAMES or (name.startswith("127.") and name.replace(".", "").isdigit())  # all of 127.0.0.0/8 is this machine's loopback
            or name in {socket.gethostname(), socket.getfqdn()} or resolves_here(name))


@dataclass(frozen=True)
class SshOptions:
    port: int | None = None
    identity_file: str | None = None
    connect_timeout: float = 30.0
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    server_alive_s: int = SERVER_ALIVE_S  # ssh's ServerAliveInterval (x SERVER_ALIVE_COUNT: a silent host's limit)


def ssh_argv(host: str, opts: SshOptions) -> list[str]:
    """The ssh command that starts the remote wrapper on ``host`` (no secret, no environment on it).
    ``--ssh-args`` come first: ssh keeps the first value it is given for an option, so the user's
    ``-o`` settings override gpucomm's defaults. Those defaults give up on a host that answers
    nothing for ``server_alive_s * SERVER_ALIVE_COUNT`` s (a cut link: ssh's own default is never),
    by default later than the ranks' liveness check, so that the ranks name the lost host first (an
    elastic job gives up sooner: ``remote.ELASTIC_SERVER_ALIVE_S``)."""
    argv = ["ssh", *opts.extra_args, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"ConnectTimeout={max(1, int(opts.connect_timeout))}",
            "-o", f"ServerAliveInterval={opts.server_alive_s}", "-o", f"ServerAliveCountMax={SERVER_ALIVE_COUNT}"]
    if opts.port is not None:
        argv += ["-p", str(opts.port)]
    if opts.identity_file is not None:
        argv += ["-i", opts.identity_file]
    package_root = str(Path(__file__).resolve().parents[2])  # so the wrapper imports this very gpucomm
    remote = (f"exec env PYTHONPATH={shlex.quote(package_root)} {shlex.quote(opts.python)} "
              f"-m gpucomm.runner.remote")
    return argv + [ssh_destination(host), remote]


SSH_CONFIG_SECONDS = 10.0  # ``ssh -G`` reads configuration files only; a limit all the same


@functools.lru_cache(maxsize=256)
def ssh_hostname(host: str, opts: SshOptions) -> str:
    """The name or address ssh connects to for ``host`` (as a host list gives it): the ``HostName`` that ssh's
    configuration gives it (``ssh -G`` prints the configuration and connects nowhere), as for a ~/.ssh/config
    alias (``Host gpu1`` / ``HostName 10.0.0.5``); ``host``'s own name where ssh cannot say (no ssh, an OpenSSH
    older than 6.8). The launcher needs it to find its own address on the route towards that host. Cached: an
    elastic launcher asks again for every worker it starts there."""
    name = unbracket(split_user(host)[1])
    argv = ["ssh", *opts.extra_args, "-G"] + (["-p", str(opts.port)] if opts.port is not None else [])
    try:
        out = subprocess.run(argv + [ssh_destination(host)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             timeout=SSH_CONFIG_SECONDS)
    except (OSError, subprocess.SubprocessError):
        return name
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        key, _, value = line.partition(" ")
        if key.lower() == "hostname" and value.strip():
            return value.strip()
    return name


def ssh_destination(host: str) -> str:
    """``host`` as ssh takes it: an IPv6 address without the brackets a host list writes it in
    (``user@[fd00::2]`` → ``user@fd00::2``; ssh reads brackets as part of the name)."""
    user, name = split_user(host)
    name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    return f"{user}@{name}" if user is not None else name


def launch_for(slot: Placement, command: list[str], base_env: Mapping[str, str], job_env: Mapping[str, str], *, cwd: str,
               ssh: SshOptions, grace: float, silence: float | None = None) -> Launch:
    """How to start one process on ``slot.host`` with ``job_env`` over the launcher's environment
    (filtered for a remote host): directly here, or through ssh and the remote wrapper. ``silence``
    (only for a caller that sends ``remote.HEARTBEAT`` every ``remote.BEAT_S``): see ``build_launches``."""
    if is_local(slot.host):
        return Launch(slot, list(command), dict(base_env) | dict(job_env))
    payload = encode_request(command, cwd, forwarded_env(base_env) | dict(job_env), grace, silence)
    return Launch(slot, ssh_argv(slot.host, ssh), dict(base_env), True, payload)


# The store's address as a rank on a host reaches it (host -> address): gpucomm-run's fixed and elastic jobs
StoreAddress = Callable[[str], str]


def build_launches(slots: list[Placement], command: list[str], base_env: Mapping[str, str], tunables: Mapping[str, str],
                   *, rendezvous_addr: StoreAddress, rendezvous_port: int, secret: bytes, run_id: str, cwd: str,
                   ssh: SshOptions, grace: float, silence: float | None = None) -> list[Launch]:
    """One ``Launch`` per slot. Local ranks get their environment directly; remote ranks get it
    through the wrapper's stdin. ``rendezvous_addr(host)``: the store's address for a rank on ``host``. ``silence``: a remote wrapper stops its rank after that long
    without the launcher's heartbeat (``remote.py``; the ``Supervisor`` sends them)."""
    launches = []
    for slot in slots:
        remote = not is_local(slot.host)
        exported = Placement(split_user(slot.host)[1], slot.rank, slot.size, slot.local_rank, slot.local_size,
                        slot.cross_rank, slot.cross_size)
        env = worker_env(base_env, exported, tunables, remote=remote, rendezvous_addr=rendezvous_addr(slot.host),
                         rendezvous_port=rendezvous_port, secret=secret, run_id=run_id)
        if remote:
            payload = encode_request(command, cwd, env, grace, silence)
            launches.append(Launch(slot, ssh_argv(slot.host, ssh), dict(base_env), True, payload))
        else:
            launches.append(Launch(slot, list(command), env))
    return launches


__all__ = ["SshOptions", "StoreAddress", "build_launches", "is_local", "launch_for", "split_user", "ssh_argv", "ssh_destination",
           "ssh_hostname"]
