"""Which address this host is reached on: a named interface's IPv4 address, or the address on the
route towards a peer."""

from __future__ import annotations

import socket


def interface_ipv4(nic: str) -> str | None:
    """The IPv4 address of local network interface ``nic``, or None when it has none (or does not exist)."""
    import psutil  # noqa: PLC0415

    for a in psutil.net_if_addrs().get(nic, []):
        if a.family == socket.AF_INET:
            return a.address
    return None


def address_towards(host: str, port: int = 9) -> str:
    """This host's address on the route towards ``host``: the address a peer there can reach us on.
    No packet is sent (a UDP socket is only connected); an unresolvable or unroutable host falls
    back to the address of this host's own name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


__all__ = ["address_towards", "interface_ipv4"]
