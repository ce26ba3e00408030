"""Host discovery for elastic jobs: the user's script says which hosts (and slots) exist now.

The script prints one ``host`` or ``host:slots`` per line (Horovod's format); hosts without a
count get ``--slots-per-host`` slots (default 1). A script that fails or prints garbage on the first
call ends the launch (misconfiguration); later failures are reported and the last good answer kept.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from .hosts import HostSpecError, HostSlots, parse_hosts
from ..errors import DiscoveryError

SCRIPT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FixedHosts:
    """``-H``/``--hostfile`` in elastic mode: the hosts never change (failed ones are still blacklisted)."""

    hosts: tuple[HostSlots, ...]

    def find(self) -> list[HostSlots]:
        return list(self.hosts)


@dataclass(frozen=True)
class DiscoveryScript:
    """Runs ``script`` (a shell command line) each time hosts are looked up."""

    script: str
    default_slots: int = 1

    def find(self) -> list[HostSlots]:
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script!r} did not finish within "
                                 f"{SCRIPT_TIMEOUT_S:g} s.") from None
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-3:]
            raise DiscoveryError(f"host discovery script {self.script!r} exited with code {done.returncode}"
                                 + (f": {' | '.join(tail)}" if tail else "") + ".")
        return parse_discovered(done.stdout, self.default_slots, self.script)


def parse_discovered(text: str, default_slots: int, where: str = "discovery") -> list[HostSlots]:
    """Hosts in the order printed; blank lines and ``#`` comments are skipped; a host listed twice is an error."""
    found: list[HostSlots] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            (entry,) = parse_hosts(line if ":" in line.rsplit("]", 1)[-1] else f"{line}:{default_slots}")
        except (HostSpecError, ValueError) as e:
            raise DiscoveryError(f"host discovery script {where!r} printed {line!r}, which is not 'host' or "
                                 f"'host:slots': {e}") from None
        if any(h.host == entry.host for h in found):
            raise DiscoveryError(f"host discovery script {where!r} listed {entry.host!r} twice; print each host once "
                                 f"with its slot count (host:slots).")
        found.append(entry)
    return found


__all__ = ["DiscoveryError", "DiscoveryScript", "FixedHosts", "parse_discovered"]
