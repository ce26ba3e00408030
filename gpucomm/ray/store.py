"""The job's rendezvous store, served by the driver as ``gpucomm-run`` serves it: a fresh secret
and run id per job, listening only on the address the workers are told (the first of ``nics``,
else the driver node's IP as Ray knows it). The secret reaches the workers as an actor method
argument (Ray's own channel), never on a command line."""

from __future__ import annotations

import secrets
from typing import Sequence

import ray

from ..bootstrap.launch_env import rendezvous_env
from ..bootstrap.netaddr import interface_ip
from ..bootstrap.placement import Placement
from ..bootstrap.rendezvous import RendezvousClient, RendezvousServer
from ..runner.worker_env import job_env


def store_address(nics: Sequence[str] | None) -> str:
    """Where the store listens and the workers reach it."""
    if nics:
        address = interface_ip(nics[0])
        if address is None:
            raise ValueError(f"gpucomm.ray: the network interface {nics[0]!r} (the first of nics) has no IPv4 "
                             f"or global IPv6 address on the driver's host, so the workers could not reach the job's store "
                             f"through it. Name an interface that exists on every node, or leave nics out.")
        return address
    return ray.util.get_node_ip_address()


class DriverStore:
    """The store of one job, open until ``close``."""

    def __init__(self, nics: Sequence[str] | None = None) -> None:
        self.addr = store_address(nics)
        self.secret = secrets.token_bytes(32)
        self.run_id = secrets.token_hex(8)
        self.server = RendezvousServer(self.secret, self.addr, 0)
        self._client: RendezvousClient | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def rank_env(self, slot: Placement) -> dict[str, str]:
        """A fixed-size job's variables for the rank at ``slot`` (place, store, secret, run id)."""
        return job_env(slot, rendezvous_addr=self.addr, rendezvous_port=self.port, secret=self.secret,
                       run_id=self.run_id)

    def meeting_env(self) -> dict[str, str]:
        """Only where to meet (an elastic worker learns its place from the rounds)."""
        return rendezvous_env(self.addr, self.port, self.secret, self.run_id)

    def client(self) -> RendezvousClient:
        """A client of this store for the driver itself (to delete what it has consumed)."""
        if self._client is None:
            self._client = RendezvousClient(self.addr, self.port, self.secret, connect_timeout=10.0, timeout=10.0)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self.server.close()


__all__ = ["DriverStore", "store_address"]
