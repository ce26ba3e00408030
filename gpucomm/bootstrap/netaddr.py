"""Which address this host is reached on: a named interface's address, or the address on the route
towards a peer (IPv4 where the peer has one, else IPv6); whether a host name or address names this
host; and listening on an address of either family."""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import socket

from ..errors import GpucommError

log = logging.getLogger("gpucomm")


class InterfaceError(GpucommError):
    """A network interface named by the user does not exist here or has no address other hosts can reach."""


def interface_address(nic: str, source: str, *, ipv6: bool | None = None) -> str:
    """The address of local network interface ``nic`` (``interface_ip``: ``ipv6`` None, either family; True or
    False, that family alone); raises ``InterfaceError`` naming ``source`` (where the name came from) and, for a
    missing interface, the ones that exist."""
    import psutil  # noqa: PLC0415

    addrs = psutil.net_if_addrs()
    if nic not in addrs:
        raise InterfaceError(f"the network interface {nic!r} ({source}) does not exist on this host; it has "
                             f"{', '.join(sorted(addrs)) or 'none'}.")
    address = interface_ip(nic, ipv6=ipv6)
    if address is None:
        lacks = ("no IPv4 address and no IPv6 address beyond its link-local one (fe80::)" if ipv6 is None else
                 "no IPv6 address beyond its link-local one (fe80::), and the job's hosts reach each other over "
                 "IPv6" if ipv6 else "no IPv4 address, and the job's hosts reach each other over IPv4")
        raise InterfaceError(f"the network interface {nic!r} ({source}) has {lacks}, so other hosts cannot be told "
                             f"where to reach it on it.")
    return address


def interface_ip(nic: str, *, ipv6: bool | None = None) -> str | None:
    """The address of local network interface ``nic`` other hosts reach: its IPv4 one, else its first IPv6 one
    that is not link-local (a link-local address needs the interface's name on the other side too), else an
    IPv4 link-local one (169.254/16); ``ipv6`` True or False: of that family alone. None when it has none (or
    does not exist)."""
    import psutil  # noqa: PLC0415

    addrs = psutil.net_if_addrs().get(nic, [])
    v4 = [a.address for a in addrs if a.family == socket.AF_INET]
    v4 = [a for a in v4 if _routable(a)] + [a for a in v4 if not _routable(a)]
    v6 = [_plain(a.address) for a in addrs if a.family == socket.AF_INET6 and _routable(_plain(a.address))]
    ordered = v6 if ipv6 else v4 if ipv6 is False else [a for a in v4 if _routable(a)] + v6 + v4
    return (ordered or [None])[0]


def unbracket(host: str) -> str:
    """``host`` without the brackets an IPv6 address is written in beside a port (``[fd00::2]`` → ``fd00::2``)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _plain(address: str) -> str:
    """An address without its IPv6 scope (``fe80::1%eth0`` → ``fe80::1``)."""
    return address.split("%", 1)[0]


def _routable(address: str) -> bool:
    """Whether other hosts can be told ``address``: not loopback, not link-local."""
    ip = ipaddress.ip_address(address)
    return not (ip.is_loopback or ip.is_link_local)


def is_ipv6(address: str) -> bool:
    """Whether ``address`` is an IPv6 address written as such (brackets and scope allowed)."""
    try:
        return ipaddress.ip_address(_plain(unbracket(address))).version == 6
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, brackets and scope allowed) is a loopback one."""
    return ipaddress.ip_address(_plain(unbracket(address))).is_loopback


def address_towards(host: str, port: int = 9) -> str:
    """This host's address on the route towards ``host``: the address a peer there can reach us on,
    IPv4 where ``host`` has an IPv4 address, else IPv6 (a name with AAAA records only, an IPv6 literal).
    No packet is sent (a UDP socket is only connected); an unresolvable or unroutable host falls back
    to the address of this host's own name. Raises ``InterfaceError`` when neither gives one."""
    why: Exception | None = None
    try:
        infos = socket.getaddrinfo(unbracket(host), port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        infos, why = [], e
    for family, _, _, _, sockaddr in sorted(infos, key=lambda info: info[0] != socket.AF_INET):
        try:  # (an IPv6 socket cannot even be made on a kernel booted with ipv6.disable=1)
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return _plain(s.getsockname()[0])
        except OSError as e:
            why = e
    try:
        own = sorted(socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM),
                     key=lambda info: info[0] != socket.AF_INET)
        return _plain(own[0][4][0])
    except (OSError, IndexError) as e:
        raise InterfaceError(
            f"this host has no route towards {host!r} ({why}), and its own name {socket.gethostname()!r} has "
            f"no address ({e}), so gpucomm cannot tell which address other ranks reach it on. Fix: set "
            f"GPUCOMM_GLOO_IFACE (gpucomm-run: --network-interface) to the interface the ranks share, or "
            f"GPUCOMM_RENDEZVOUS_ADDR to an address of rank 0's host.") from None


DEFAULT_ROUTE_PROBE = "8.8.8.8"  # an address on the default route (no packet is ever sent to it)
DEFAULT_ROUTE_PROBE6 = "2001:4860:4860::8888"  # the same for IPv6's default route


def address_for_peers(host: str, port: int = 9, *, warn: bool = True) -> str:
    """The address ranks on other hosts reach this host on: the one on the route towards ``host`` (the address
    every rank was given). When ``host`` is a name that resolves to loopback here while the others resolve it to
    this host (Debian's /etc/hosts line for the host's own name; torchrun's MASTER_ADDR, the node's FQDN), the
    one on the default route instead (IPv4's, else IPv6's), or with none this host's only other IPv4 address
    (with no IPv4 one, its only global IPv6 one); with neither, the loopback one, and a warning (ranks on other
    machines cannot reach it; ``warn=False``: the caller says what is wrong). A loopback address given as such
    (``127.0.0.1``, ``::1``, ``localhost``: a launcher's choice for ranks of this machine) is kept."""
    mine = address_towards(host, port)
    if not is_loopback(mine) or _loopback_literal(host):
        return mine
    for probe in (DEFAULT_ROUTE_PROBE, DEFAULT_ROUTE_PROBE6):
        try:
            other = address_towards(probe)
        except InterfaceError:  # no route, and this host's own name has no address
            continue
        if not is_loopback(other):
            return other
    import psutil  # noqa: PLC0415

    found = {_plain(a.address) for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family in (socket.AF_INET, socket.AF_INET6) and _routable(_plain(a.address))}
    v4 = sorted(a for a in found if not is_ipv6(a))
    candidates = v4 or sorted(found)
    if len(candidates) == 1 or not warn:
        return candidates[0] if len(candidates) == 1 else mine
    log.warning("gpucomm: %r, the address the ranks were given, resolves to loopback (%s) on this host, which has no "
                "default route and %s; ranks on other machines cannot reach a loopback address. If this job spans "
                "machines, set GPUCOMM_RENDEZVOUS_ADDR (torchrun: also --rdzv-endpoint/--master-addr) to this host's "
                "address on the network the ranks share, or GPUCOMM_GLOO_IFACE to its interface.", host, mine,
                f"several addresses ({', '.join(candidates)})" if candidates else "no other address")
    return mine


WILDCARD = "::"  # listen on every interface, IPv4 and IPv6 (``listening_socket`` falls back to 0.0.0.0)


def listening_socket(host: str, port: int = 0, *, backlog: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` in ``host``'s family: an IPv6 address (brackets allowed) gets an
    IPv6 socket, any other address or name an IPv4 one. ``::`` listens on every interface of both families
    where the kernel allows it (dual stack), else on every IPv4 one; ``0.0.0.0`` on every IPv4 one."""
    address = unbracket(host)
    if address == WILDCARD:
        if socket.has_dualstack_ipv6():
            try:
                return socket.create_server((WILDCARD, port), family=socket.AF_INET6, backlog=backlog,
                                            dualstack_ipv6=True)
            except OSError as e:  # IPv6 switched off on this host; any other failure (a port in use) is the caller's
                if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    raise
        address = "0.0.0.0"
    family = socket.AF_INET6 if is_ipv6(address) else socket.AF_INET
    return socket.create_server((address, port), family=family, backlog=backlog)


def host_port(host: str, port: int) -> str:
    """``host:port`` as users write it: an IPv6 address in brackets (``[fd00::2]:29500``)."""
    return f"[{unbracket(host)}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def _loopback_literal(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address written as such (not a name resolving to one)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(unbracket(host)).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (IPv4 or IPv6; None: no interface does)."""
    import psutil  # noqa: PLC0415

    wanted = _plain(unbracket(address))
    for nic, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and _plain(a.address) == wanted for a in addrs):
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
        infos = socket.getaddrinfo(unbracket(name), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    resolved = {info[4][0].split("%")[0] for info in infos}
    if any(ipaddress.ip_address(a).is_loopback for a in resolved):
        return True
    return bool(resolved & local_addresses())


__all__ = ["DEFAULT_ROUTE_PROBE", "DEFAULT_ROUTE_PROBE6", "InterfaceError", "WILDCARD", "address_for_peers",
           "address_towards", "host_port", "interface_address", "interface_ip", "interface_of", "is_ipv6", "is_loopback",
           "listening_socket", "local_addresses", "resolves_here", "unbracket"]
