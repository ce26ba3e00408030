"""The environment each rank starts with: its slot, the rendezvous store, the job secret and the
tunables, under both the ``GPUCOMM_*`` and the ``HOROVOD_*`` names (scripts written for Horovod read
the latter). The secret travels only in the environment (or an ssh stdin), never on a command line.
"""

from __future__ import annotations

from typing import Mapping

from ..bootstrap.launch_env import rendezvous_env
from ..bootstrap.placement import Placement, placement_env

# Launcher variables a remote host must not inherit from this one: they describe this shell, this
# login or this host, and the remote login sets its own.
NOT_FORWARDED = frozenset({
    "HOSTNAME", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "TERMCAP",
    "DISPLAY", "MAIL", "LS_COLORS", "TMUX", "TMUX_PANE", "STY", "WINDOW", "COLUMNS", "LINES", "PS1",
    "SSH_AUTH_SOCK", "SSH_AGENT_PID", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "XAUTHORITY",
})
NOT_FORWARDED_PREFIXES = ("BASH_FUNC_", "XDG_", "SSH_")


def job_env(slot: Placement, *, rendezvous_addr: str, rendezvous_port: int, secret: bytes, run_id: str) -> dict[str, str]:
    """``placement_env`` and where to meet: the store's address, the job secret and the run id."""
    return placement_env(slot) | rendezvous_env(rendezvous_addr, rendezvous_port, secret, run_id)


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of the launcher's environment a rank on another host receives (PATH, PYTHONPATH,
    LD_LIBRARY_PATH, CUDA and NCCL settings, ...), without this login's own variables."""
    return {k: v for k, v in env.items()
            if k not in NOT_FORWARDED and not k.startswith(NOT_FORWARDED_PREFIXES)}


def worker_env(base: Mapping[str, str], slot: Placement, tunables: Mapping[str, str], *, remote: bool,
               rendezvous_addr: str, rendezvous_port: int, secret: bytes, run_id: str) -> dict[str, str]:
    """The whole environment of one rank: the launcher's (filtered for a remote host), then the
    tunables, then the job variables (which nothing overrides)."""
    env = forwarded_env(base) if remote else dict(base)
    env.update(tunables)
    env.update(job_env(slot, rendezvous_addr=rendezvous_addr, rendezvous_port=rendezvous_port,
                       secret=secret, run_id=run_id))
    return env


__all__ = ["NOT_FORWARDED", "forwarded_env", "job_env", "worker_env"]
