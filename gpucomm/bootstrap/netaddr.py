"""Which address this host is reached on: a named interface's IPv4 address, or the address on the
route towards a peer; and whether a host name or address names this host."""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket

from ..errors import GpucommError

log = logging.getLogger("gpucomm")


class InterfaceError(GpucommError):
    """A network interface named by the user does not exist here or has no IPv4 address."""


def interface_address(nic: str, source: str) -> str:
    """The IPv4 address of local network interface ``nic``; raises ``InterfaceError`` naming
    ``source`` (where the name came from) and, for a missing interface, the ones that exist."""
    import psutil  # noqa: PLC0415

    addrs = psutil.net_if_addrs()
    if nic not in addrs:
        raise InterfaceError(f"the network interface {nic!r} ({source}) does not exist on this host; it has "
                             f"{', '.join(sorted(addrs)) or 'none'}.")
    address = interface_ipv4(nic)
    if address is None:
        raise InterfaceError(f"the network interface {nic!r} ({source}) has no IPv4 address.")
    return address


def interface_ipv4(nic: str) -> str | None:
    """The IPv4 address of local network interface ``nic``, or None when it has none (or does not exist)."""
    import psutil  # noqa: PLC0415

    for a in psutil.net_if_addrs().get(nic, []):
        if a.family == socket.AF_INET:
            return a.address
    return None


class IPv6OnlyError(GpucommError):
    """An address the job must reach is IPv6 only: gpucomm's bootstrap is IPv4 for now."""


def require_ipv4(host: str, what: str) -> None:
    """Raise ``IPv6OnlyError`` when ``host`` (``what`` names where it came from) is an IPv6 address or a name
    with IPv6 (AAAA) addresses only. gpucomm's store, control plane and Gloo interface choice use IPv4, so such
    a job would fail on a lookup, or wait for a rank that looks for the store elsewhere, until the start timeout.
    A name that does not resolve at all is left to the caller's own error."""
    name = host.strip("[]")
    try:
        literal = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        literal = None
    if literal is None:
        try:
            families = {info[0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
        except (OSError, UnicodeError):
            return
        if socket.AF_INET in families or socket.AF_INET6 not in families:
            return
    elif literal.version == 4:
        return
    raise IPv6OnlyError(
        f"{what} {host!r} is {'an IPv6 address' if literal is not None else 'a name with IPv6 addresses only'}, "
        f"and gpucomm's bootstrap (its rendezvous store, control plane and choice of Gloo's interface) works over "
        f"IPv4 only for now. Fix: give an IPv4 address, or a host name with an IPv4 (A) record; on an IPv6-only "
        f"network (a single-stack Kubernetes cluster) gpucomm cannot run across hosts yet.")


def address_towards(host: str, port: int = 9) -> str:
    """This host's address on the route towards ``host``: the address a peer there can reach us on.
    No packet is sent (a UDP socket is only connected); an unresolvable or unroutable host falls
    back to the address of this host's own name. Raises ``InterfaceError`` when neither gives one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError as e:
            why = e
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise InterfaceError(
            f"this host has no IPv4 route towards {host!r} ({why}), and its own name {socket.gethostname()!r} has "
            f"no IPv4 address ({e}), so gpucomm cannot tell which address other ranks reach it on. Fix: set "
            f"GPUCOMM_GLOO_IFACE (gpucomm-run: --network-interface) to the interface the ranks share, or "
            f"GPUCOMM_RENDEZVOUS_ADDR to an IPv4 address of rank 0's host.") from None


DEFAULT_ROUTE_PROBE = "8.8.8.8"  # an address on the default route (no packet is ever sent to it)


def address_for_peers(host: str, port: int = 9) -> str:
    """The address ranks on other hosts reach this host on: the one on the route towards ``host`` (the address
    every rank was given). When ``host`` is a name that resolves to loopback here while the others resolve it to
    this host (Debian's /etc/hosts line for the host's own name; torchrun's MASTER_ADDR, the node's FQDN), the
    one on the default route instead, or with none this host's only other IPv4 address; with neither, the
    loopback one, and a warning (ranks on other machines cannot reach it). A loopback address given as such
    (``127.0.0.1``, ``localhost``: a launcher's choice for ranks of this machine) is kept."""
    mine = address_towards(host, port)
    if not mine.startswith("127.") or _loopback_literal(host):
        return mine
    try:
        other = address_towards(DEFAULT_ROUTE_PROBE)
    except InterfaceError:  # no route, and this host's own name has no IPv4 address
        other = mine
    if not other.startswith("127."):
        return other
    import psutil  # noqa: PLC0415

    candidates = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                         if a.family == socket.AF_INET and not a.address.startswith("127.")})
    if len(candidates) == 1:
        return candidates[0]
    log.warning("gpucomm: %r, the address the ranks were given, resolves to loopback (%s) on this host, which has no "
                "default route and %s; ranks on other machines cannot reach a loopback address. If this job spans "
                "machines, set GPUCOMM_RENDEZVOUS_ADDR (torchrun: also --rdzv-endpoint/--master-addr) to this host's "
                "address on the network the ranks share, or GPUCOMM_GLOO_IFACE to its interface.", host, mine,
                f"several addresses ({', '.join(candidates)})" if candidates else "no other address")
    return mine


def _loopback_literal(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address written as such (not a name resolving to one)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address`` (None: no interface does)."""
    import psutil  # noqa: PLC0415

    for nic, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return nic
    return None


def local_addresses() -> frozenset[str]:
    """Every IPv4 and IPv6 address of this host's network interfaces (in this network namespace)."""
    import psutil  # noqa: PLC0415

    return frozenset(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                     if a.family in (socket.AF_INET, socket.AF_INET6))


@functools.lru_cache(maxsize=256)
def resolves_here(name: str) -> bool:
    """Whether ``name`` (a host name or an address) resolves to a loopback address or to an address
    of one of this host's interfaces: Horovod's rule for a host that needs no ssh. A name that does
    not resolve is not this host. Cached per name (a launcher asks about the same hosts often)."""
    try:
        infos = socket.getaddrinfo(name.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    resolved = {info[4][0].split("%")[0] for info in infos}
    if any(ipaddress.ip_address(a).is_loopback for a in resolved):
        return True
    return bool(resolved & local_addresses())


__all__ = ["DEFAULT_ROUTE_PROBE", "IPv6OnlyError", "InterfaceError", "address_for_peers", "address_towards",
           "interface_address", "interface_ipv4", "interface_of", "local_addresses", "require_ipv4", "resolves_here"]
