"""Host lists and slot assignment for ``gpucomm-run``: pure functions, no I/O but reading a hostfile.

A rank's place (``gpucomm.bootstrap.placement.Placement``) says which host it runs on and its rank,
local rank and cross rank.
Ranks fill hosts in the order given, ``slots`` ranks per host (Horovod's rule), so ranks on one host
are contiguous and local rank 0 of every host is the first rank placed there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from ..bootstrap.placement import Placement
from ..errors import HostSpecError


@dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks it may run."""

    host: str
    slots: int


_HOST = re.compile(r"^[A-Za-z0-9_.\-@\[\]:]+$")


def _check_host(host: str, where: str) -> str:
    if not host or not _HOST.match(host):
        raise HostSpecError(f"{where}: {host!r} is not a host name or address. Use names such as "
                            f"node1, node1.example.com, user@node1, 10.0.0.1 or [fd00::1].")
    return host


def _split_host_slots(item: str, where: str) -> HostSlots:
    """``host:N``, ``[v6addr]:N`` or ``host`` (one slot), each with an optional ``user@`` before it."""
    item = item.strip()
    user = ""
    if "@" in item.split("[", 1)[0]:  # user@host or user@[v6addr]: the user is not part of the address
        user, item = item.split("@", 1)
        user += "@"
    if item.startswith("["):  # bracketed IPv6 address
        end = item.find("]")
        if end < 0:
            raise HostSpecError(f"{where}: {item!r} opens '[' without closing it; write [::1]:2.")
        host, rest = user + item[: end + 1], item[end + 1:]
        if rest and not rest.startswith(":"):
            raise HostSpecError(f"{where}: {item!r} has text after the address; write [::1]:2.")
        count = rest[1:] if rest else None
    elif item.count(":") == 1:
        host, count = item.split(":")
        host = user + host
    elif ":" in item:
        raise HostSpecError(f"{where}: {item!r} has several ':'; put an IPv6 address in brackets: [::1]:2.")
    else:
        host, count = user + item, None
    slots = 1
    if count is not None:
        if not count.isdigit() or int(count) < 1:
            raise HostSpecError(f"{where}: {item!r} gives {count!r} slots; the slot count must be a positive "
                                f"integer, as in {host or 'node1'}:4.")
        slots = int(count)
    return HostSlots(_check_host(host, where), slots)


def _merge(entries: list[HostSlots], where: str) -> list[HostSlots]:
    seen: set[str] = set()
    for e in entries:
        if e.host in seen:
            raise HostSpecError(f"{where}: host {e.host!r} is listed twice; give it once with the total slot count.")
        seen.add(e.host)
    if not entries:
        raise HostSpecError(f"{where}: no hosts given.")
    return entries


def parse_hosts(spec: str) -> list[HostSlots]:
    """Parse ``-H host1:2,host2:4`` (a host without ``:N`` has one slot)."""
    items = [s for s in spec.split(",") if s.strip()]
    return _merge([_split_host_slots(s, f"-H {spec!r}") for s in items], f"-H {spec!r}")


def parse_hostfile_text(text: str, name: str = "hostfile") -> list[HostSlots]:
    """Parse hostfile lines ``host slots=N`` (also ``host:N`` or a bare host); ``#`` starts a comment."""
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name} line {lineno}"
        fields = line.split()
        if len(fields) == 1:
            entries.append(_split_host_slots(fields[0], where))
            continue
        host = _check_host(fields[0], where)
        slots = None
        for field in fields[1:]:
            key, _, value = field.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value:
                if not value.isdigit() or int(value) < 1:
                    raise HostSpecError(f"{where}: {field!r} must be a positive integer, as in 'slots=4'.")
                if key == "slots":
                    slots = int(value)
            else:
                raise HostSpecError(f"{where}: cannot read {field!r}; hostfile lines look like 'node1 slots=4'.")
        entries.append(HostSlots(host, slots or 1))
    return _merge(entries, name)


def parse_hostfile(path: str | Path) -> list[HostSlots]:
    """Read a hostfile; a missing file is a ``HostSpecError`` naming the path."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostSpecError(f"cannot read hostfile {str(path)!r}: {e.strerror or e}") from None
    return parse_hostfile_text(text, str(path))


def assign_slots(hosts: list[HostSlots], np: int) -> list[Placement]:
    """Place ``np`` ranks on ``hosts``, filling each host's slots in order.

    Hosts that get no rank are left out of the job. The cross rank of a rank is its index among
    the ranks with the same local rank, so that ``cross_size`` is the number of hosts that have a
    rank with that local rank (Horovod's definition; it differs per local rank on uneven layouts).
    """
    if np < 1:
        raise HostSpecError(f"-np {np}: the job needs at least one process.")
    total = sum(h.slots for h in hosts)
    if np > total:
        listing = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
        raise HostSpecError(f"-np {np} asks for more processes than the {total} slots available ({listing}). "
                            f"Lower -np or add slots: -H host:N gives a host N slots.")
    placed: list[tuple[str, int]] = []  # (host, local_rank) per rank
    local_sizes: dict[str, int] = {}
    for h in hosts:
        take = min(h.slots, np - len(placed))
        if take == 0:
            break
        placed.extend((h.host, lr) for lr in range(take))
        local_sizes[h.host] = take
    by_local_rank: dict[int, list[int]] = {}
    for rank, (_, lr) in enumerate(placed):
        by_local_rank.setdefault(lr, []).append(rank)
    slots = []
    for rank, (host, lr) in enumerate(placed):
        peers = by_local_rank[lr]
        slots.append(Placement(host, rank, np, lr, local_sizes[host], peers.index(rank), len(peers)))
    return slots


__all__ = ["HostSlots", "HostSpecError", "assign_slots", "parse_hostfile", "parse_hostfile_text",
           "parse_hosts"]
