"""A cluster in a box: N hosts made of Linux network namespaces on one bridge, each with its own
address, host name and OpenSSH server, for tests of multi-host jobs and network faults.

``cluster(n)`` yields a ``Cluster`` whose hosts are ``node0`` .. ``node{n-1}``:

* a host is a network namespace (``ip netns``) with a veth pair into a bridge that lives in a
  namespace of its own (the switch), so nothing is added to the machine's own network: the test
  addresses (10.213.0.0/24, and 10.213.1.0/24 for a second, data network; fd00:213::/64 for IPv6-only hosts) exist only inside the
  namespaces this module creates;
* every process started on a host runs under ``ip netns exec`` (which also mounts the host's own
  ``/etc/hosts``, naming every host, and an empty ``resolv.conf``) in a UTS namespace of its own whose
  host name is the host's (``Host.argv``), as on separate machines;
* each host runs ``sshd`` on its cluster address with a host key and an authorized key generated for
  this cluster (``Cluster.launcher_flags()`` gives gpucomm-run the matching ``-i`` and ``--ssh-args``);
* links may be rate-limited (``tc`` token bucket on both ends of a host's veth), cut and restored
  (``cut``/``restore``: the bridge's end goes down, like a pulled cable), and hosts added and removed
  (``add_host``/``remove_host``: a namespace that appears or disappears).

Tear-down kills every process in the cluster's namespaces by pid (the namespace is what marks them
as the test's), then deletes the namespaces and their files, also when the test failed; namespaces
left by a test process that was itself killed are swept by the next cluster (their names carry the
creating pid). ``unavailable()`` says why hosts cannot be made here (not root, no ``ip netns``, no
``sshd``); tests skip with that reason. ``.ci/run`` installs OpenSSH's server.

Short admin commands (``ip``, ``tc``, ``ssh-keygen``) run through ``admin`` with a deadline; every
other process starts through ``tests/harness.py`` (``run``, ``started``) like any other test's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import re
import threading
import shutil
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import psutil

from tests.harness import Result, run, started
from tests.steps import selected

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd")
PREFIX = "gcnet"  # every namespace this module creates: gcnet-<pid>-<cluster>-<host>
CLUSTER_NET = "10.213.0"  # /24, hosts from .2
DATA_NET = "10.213.1"  # the second network, when a cluster has one
CLUSTER_NET6 = "fd00:213::"  # /64, hosts from ::2, on a cluster made with ipv6_only
LIFETIME = 3600.0  # seconds an sshd may serve before the harness kills it (a module's tests, at most)
SSH_OPTIONS = ("-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR")
ADMIN_TIMEOUT = 30.0
_COUNTER = itertools.count()


class ClusterError(RuntimeError):
    """A host could not be made, changed or removed; the message holds the command and its output."""


def admin(*argv: str, timeout: float = ADMIN_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    """Run a short administrative command (``ip``, ``tc``, ...) to completion, killed at ``timeout``."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(argv)} did not finish in {timeout:g} s") from None
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def netns_selected(config: Any) -> bool:
    """Whether this pytest run asked for the namespace tests (``-m netns``, or ``GPUCOMM_TEST_NETNS=1``):
    they start many processes and take minutes, so the main run leaves them to their own CI step."""
    return selected(config, "netns")


def require_netns(config: Any) -> None:
    """Skip the calling test, with the reason, unless namespace hosts were asked for and can be made."""
    import pytest  # noqa: PLC0415 - only tests call this

    if not netns_selected(config):
        pytest.skip("namespace-host tests run in their own step: `python -m pytest -m netns` as root (.ci/run does)")
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"cannot make namespace hosts here: {reason}")


def _sshd() -> str | None:
    return next((p for p in SSHD_CANDIDATES if os.path.exists(p)), None) or shutil.which("sshd")


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why namespace hosts cannot be made on this machine, or None when they can (asked once per process)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the netns tests as root, as .ci/run does)"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2, util-linux and openssh-client provide them)"
    if _sshd() is None:
        return "OpenSSH's server is not installed (apt-get install openssh-server; .ci/run does this)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = admin("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails here ({made.stderr.strip()}): no network namespaces in this sandbox"
    try:
        veth = admin("ip", "link", "add", "name", "gcp0", "netns", probe, "type", "veth", "peer", "name", "gcp1", "netns", probe,
                     check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here ({veth.stderr.strip()})"
    finally:
        admin("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One host of a cluster: a network namespace with an address (and a data address on a cluster
    with a second network), named ``name`` in every host's ``/etc/hosts`` and in its own UTS namespace."""

    name: str
    netns: str
    index: int
    address: str
    data_address: str | None
    sshd: Any = None  # the harness's Started for its sshd
    ports: tuple[str, ...] = ()  # its veths' ends on the bridges (in the switch namespace)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run on this host: in its network namespace and /etc files, under its host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *map(str, cmd)]


@dataclass
class Cluster:
    """Hosts on a bridge; see the module's docstring. ``start_seconds``/``stop_seconds``: how long
    making and tearing down the cluster took."""

    tag: str
    tmp: Path
    data_network: bool
    rate: str | None
    loopback_names: bool = False
    ipv6_only: bool = False
    hosts: list[Host] = field(default_factory=list)
    removed: list[Host] = field(default_factory=list)
    start_seconds: float = 0.0
    stop_seconds: float = 0.0
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _next: Iterator[int] = field(default_factory=itertools.count)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def key(self) -> str:
        return str(self.tmp / "user_key")

    def ssh_argv(self, host: Host, command: str) -> list[str]:
        """The ssh command that runs ``command`` on ``host`` as root with the cluster's key."""
        return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *SSH_OPTIONS, "-i", self.key,
                f"root@{host.address}", command]

    def launcher_flags(self) -> list[str]:
        """gpucomm-run's ssh flags for this cluster's hosts (``-i`` and ``--ssh-args``)."""
        return ["-i", self.key, "--ssh-args", " ".join(SSH_OPTIONS)]

    def ssh_command(self) -> str:
        """An executable that runs ssh with the cluster's key and options (``ssh_command() HOST CMD``), for
        launchers that take a program rather than flags: MPICH's ``-launcher-exec``, Open MPI's
        ``plm_rsh_agent``."""
        path = self.tmp / "ssh"
        if not path.exists():
            flags = " ".join(["-o", "BatchMode=yes", *SSH_OPTIONS, "-i", self.key])
            path.write_text(f"#!/bin/sh\nexec ssh {flags} \"$@\"\n")
            path.chmod(0o755)
        return str(path)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # ------------------------------------------------------------------ making and removing hosts

    def _make_switch(self) -> None:
        admin("ip", "netns", "add", self.switch)
        for bridge in ("br0", "br1") if self.data_network else ("br0",):
            admin("ip", "-n", self.switch, "link", "add", bridge, "type", "bridge", "forward_delay", "0")
            admin("ip", "-n", self.switch, "link", "set", bridge, "up")

    def add_host(self, *, rate: str | None = None, probe: bool = True) -> Host:
        """Make one more host (its namespace, link, address, name and sshd) and wait until it takes
        ssh logins; ``rate`` (tc's syntax, e.g. ``1gbit``) limits its link both ways."""
        i = next(self._next)
        address = f"{CLUSTER_NET6}{i + 2:x}" if self.ipv6_only else f"{CLUSTER_NET}.{i + 2}"
        host = Host(f"node{i}", f"{self.tag}-h{i}", i, address, f"{DATA_NET}.{i + 2}" if self.data_network else None)
        self.hosts.append(host)
        admin("ip", "netns", "add", host.netns)
        admin("ip", "-n", host.netns, "link", "set", "lo", "up")
        links = [("eth0", "br0", host.address)] + ([("eth1", "br1", host.data_address)] if self.data_network else [])
        for nic, bridge, address in links:
            port = f"h{i}{nic[-1]}"
            admin("ip", "link", "add", nic, "netns", host.netns, "type", "veth", "peer", "name", port, "netns",
                  self.switch)
            admin("ip", "-n", self.switch, "link", "set", port, "master", bridge, "up")
            if ":" in address:  # (nodad: usable at once, not after duplicate address detection's second or two)
                admin("ip", "-n", host.netns, "addr", "add", f"{address}/64", "dev", nic, "nodad")
            else:
                admin("ip", "-n", host.netns, "addr", "add", f"{address}/24", "dev", nic)
            admin("ip", "-n", host.netns, "link", "set", nic, "up")
            host.ports += (port,)
        if rate or self.rate:
            self.limit(host, rate or self.rate)
        self._write_etc()
        host.sshd = self._stack.enter_context(self._serve_ssh(host))
        if probe:
            self.wait_for_ssh([host])
        return host

    def add_address(self, host: Host, address: str, *, name_it: bool = False) -> None:
        """Give ``host``'s first NIC one more address (IPv4 or IPv6, in the cluster's networks); ``name_it``:
        its name resolves to that address alone from now on (every host's /etc/hosts), as a host readdressed."""
        if ":" in address:
            admin("ip", "-n", host.netns, "addr", "add", f"{address}/64", "dev", "eth0", "nodad")
        else:
            admin("ip", "-n", host.netns, "addr", "add", f"{address}/24", "dev", "eth0")
        if name_it:
            host.address = address
            self._write_etc()

    def remove_host(self, host: Host) -> list[str]:
        """Take ``host`` away as a machine that disappears: every process on it is killed, then its
        namespace (and so its link) is deleted. Returns the processes that were still running."""
        killed = self.kill_all(host)
        admin("ip", "netns", "del", host.netns, check=False)
        shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)
        self.hosts.remove(host)
        self.removed.append(host)
        self._write_etc()
        return killed

    def _write_etc(self) -> None:
        """Every host's /etc/hosts names every host (written in place: ``ip netns exec`` bind-mounts
        the file, so processes already running see the change); resolv.conf is empty (no DNS). With
        ``loopback_names`` a host's own name maps to 127.0.1.1 there, as Debian's installer writes it."""
        for h in self.hosts:
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
            if self.loopback_names:
                lines.append(f"127.0.1.1 {h.name}")
            for other in self.hosts:
                if other is not h or not self.loopback_names:
                    lines.append(f"{other.address} {other.name}")
                if other.data_address:
                    lines.append(f"{other.data_address} {other.name}-data")
            text = "\n".join(lines) + "\n"
            etc = Path(f"/etc/netns/{h.netns}")
            etc.mkdir(parents=True, exist_ok=True)
            for name, content in (("hosts", text), ("resolv.conf", "")):
                with open(etc / name, "a+") as f:  # in place: the same inode stays mounted
                    f.seek(0)
                    f.truncate()
                    f.write(content)

    @contextlib.contextmanager
    def _serve_ssh(self, host: Host) -> Iterator[Any]:
        config = self.tmp / f"sshd_{host.name}"
        config.write_text(sshd_config(22, host.address, self.tmp, self.tmp / f"sshd_{host.name}.pid",
                                      extra="MaxStartups 100\nMaxSessions 100\n"))
        log = open(self.tmp / f"sshd_{host.name}.log", "w")  # noqa: SIM115 - closed below
        try:
            with started(host.argv([_sshd(), "-D", "-e", "-f", str(config)]), stdout=subprocess.DEVNULL, stderr=log,
                         timeout=LIFETIME, inherit_env=True) as server:
                yield server
        finally:
            log.close()

    def wait_for_ssh(self, hosts: Sequence[Host], timeout: float = 30.0) -> None:
        """Wait until every host in ``hosts`` takes an ssh login from the first host (probes in parallel)."""
        deadline = time.monotonic() + timeout
        pending, last = list(hosts), ""
        while pending and time.monotonic() < deadline:
            with contextlib.ExitStack() as stack:
                probes = [(h, stack.enter_context(started(self.hosts[0].argv(self.ssh_argv(h, "true")),
                                                          timeout=max(1.0, deadline - time.monotonic()),
                                                          inherit_env=True)))
                          for h in pending]
                for h, probe in probes:
                    out, err = probe.proc.communicate()
                    if probe.proc.returncode == 0:
                        pending.remove(h)
                    else:
                        last = f"{h.name}: {err.strip()}"
            if pending:
                time.sleep(0.1)
        if pending:
            logs = "; ".join(f"{h.name}'s sshd: {self._sshd_log(h)}" for h in pending)
            raise ClusterError(f"hosts {[h.name for h in pending]} took no ssh login within {timeout:g} s (last: "
                               f"{last}; {logs})")

    def _sshd_log(self, host: Host) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / f"sshd_{host.name}.log").read_text().strip()[-500:] or "(empty log)"
        return "(no log)"

    # ------------------------------------------------------------------ links

    def limit(self, host: Host, rate: str, *, burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit ``host``'s links to ``rate`` in both directions (a token bucket on each veth end)."""
        for nic, port in zip(("eth0", "eth1"), host.ports):
            for ns, dev in ((host.netns, nic), (self.switch, port)):
                admin("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                      "latency", latency)

    def cut(self, host: Host, *, side: str = "bridge") -> None:
        """Cut ``host`` off the network: its ports on the bridges go down (``side="bridge"``: a pulled
        cable; the host's own NICs stay up and silently lose every packet), or its NICs do
        (``side="host"``: sends fail at once on that host)."""
        self._set_links(host, side, "down")

    def restore(self, host: Host, *, side: str = "bridge") -> None:
        """Undo ``cut``."""
        self._set_links(host, side, "up")

    def _set_links(self, host: Host, side: str, state: str) -> None:
        if side not in ("bridge", "host"):
            raise ValueError(f"side={side!r}: a link is cut on the 'bridge' side or the 'host' side")
        for nic, port in zip(("eth0", "eth1"), host.ports):
            ns, dev = (self.switch, port) if side == "bridge" else (host.netns, nic)
            admin("ip", "-n", ns, "link", "set", dev, state)

    # ------------------------------------------------------------------ processes

    def run(self, host: Host, cmd: Sequence[str], **kwargs: Any) -> Result:
        """``harness.run`` of ``cmd`` on ``host``."""
        return run(host.argv(cmd), **kwargs)

    def started(self, host: Host, cmd: Sequence[str], **kwargs: Any):
        """``harness.started`` of ``cmd`` on ``host``."""
        return started(host.argv(cmd), **kwargs)

    def pids(self, host: Host) -> list[int]:
        """Every process in ``host``'s network namespace."""
        out = admin("ip", "netns", "pids", host.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def processes(self, host: Host, *, sessions: bool = False) -> list[str]:
        """What runs on ``host`` besides its sshd listener (``ip netns exec``, ``unshare`` and ``sh``
        exec into it, so it keeps the pid the harness started), described as ``pid on host: command``.
        ``sessions``: also sshd's per-connection processes (``sshd: root@notty``), which are sshd's,
        not the job's: one whose client vanished with a cut link lingers until TCP gives up on it."""
        keep = {host.sshd.proc.pid} if host.sshd is not None else set()
        found = []
        for pid in self.pids(host):
            try:
                p = psutil.Process(pid)
                if pid in keep or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                command = " ".join(p.cmdline()).strip()
                if command.startswith("sshd:") and not sessions:
                    continue
                found.append(f"pid {pid} on {host.name}: {command}")
            except psutil.Error:
                continue
        return found

    def leftovers(self, settle: float = 5.0, *, sessions: bool = False) -> list[str]:
        """Processes still running on any host (besides the sshd listeners, and sshd's sessions unless
        ``sessions``) once ``settle`` s have passed without them all ending; described, not killed."""
        deadline = time.monotonic() + settle
        while True:
            left = [p for h in self.hosts for p in self.processes(h, sessions=sessions)]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    @contextlib.contextmanager
    def watch(self, host: Host, cmd: Sequence[str], *, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> Iterator["Watched"]:
        """``cmd`` (a launcher) started on ``host`` through ``harness.started``, its output lines
        time-stamped as they come (``Watched``); killed with everything it started when the block ends."""
        with self.started(host, cmd, timeout=timeout, env=env) as handle:
            watched = Watched(handle)
            yield watched

    def kill_all(self, host: Host) -> list[str]:
        """SIGKILL every process in ``host``'s namespace (by pid) and wait for them; returns what ran."""
        procs = []
        described = []
        for pid in self.pids(host):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                described.append(f"pid {pid} on {host.name}: {' '.join(p.cmdline())}")
                procs.append(p)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        return described

    def close(self) -> None:
        """Kill everything on every host, delete the namespaces and their files."""
        t0 = time.monotonic()
        try:
            for host in list(self.hosts):
                self.kill_all(host)
            self._stack.close()  # the sshd handles: already dead, reaped here
        finally:
            for host in self.hosts:
                admin("ip", "netns", "del", host.netns, check=False)
                shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)
            admin("ip", "netns", "del", self.switch, check=False)
            self.stop_seconds = time.monotonic() - t0


class Watched:
    """A started launcher whose stdout and stderr lines arrive, time-stamped (``time.time()``, which
    every host shares), in ``lines``; tests wait for lines and act between them."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.proc = handle.proc
        self.lines: list[tuple[float, str, str]] = []  # (time, "out" | "err", line)
        self._queue: queue.Queue = queue.Queue()
        self._open = 2
        for stream, tag in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            threading.Thread(target=self._pump, args=(stream, tag), daemon=True).start()

    def _pump(self, stream: Any, tag: str) -> None:
        try:
            for line in stream:
                self._queue.put((time.time(), tag, line.rstrip("\n")))
        except (OSError, ValueError):
            pass
        self._queue.put(None)

    def _take(self, timeout: float) -> bool:
        """Move one line (or an end of stream) from the pumps to ``lines``; False when none came."""
        try:
            item = self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return False
        if item is None:
            self._open -= 1
        else:
            self.lines.append(item)
        return True

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 120.0) -> list[tuple[float, str, str]]:
        """Wait until ``count`` lines match the regular expression ``pattern``; returns them. Fails
        (AssertionError, with the output so far) if the launcher ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            found = [item for item in self.lines if rx.search(item[2])]
            if len(found) >= count:
                return found[:count]
            if self._open == 0 or time.monotonic() >= deadline:
                raise AssertionError(f"{count} line(s) matching {pattern!r} did not appear (got {len(found)}) "
                                     f"within {timeout:g} s; output:\n{self.text()[-6000:]}")
            self._take(min(0.5, deadline - time.monotonic()))

    def wait_exit(self, timeout: float) -> int:
        """Wait for the launcher to exit (and its output to end); its exit status. A launcher still
        running at ``timeout`` fails the test (the harness then kills it)."""
        deadline = time.monotonic() + timeout
        while self._open and time.monotonic() < deadline:
            self._take(min(0.5, deadline - time.monotonic()))
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher did not end within {timeout:g} s (a hang); output:\n"
                                 f"{self.text()[-6000:]}") from None

    def when(self, pattern: str) -> float | None:
        """When the first line matching ``pattern`` arrived (None: none did)."""
        rx = re.compile(pattern)
        return next((t for t, _, line in self.lines if rx.search(line)), None)

    def text(self) -> str:
        return "\n".join(line for _, _, line in self.lines)


def _keys(tmp: Path) -> None:
    for key in ("host_key", "user_key"):
        admin("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / key), timeout=60)
    (tmp / "authorized_keys").write_text((tmp / "user_key.pub").read_text())
    (tmp / "authorized_keys").chmod(0o600)


def sshd_config(port: int, address: str, keys: Path, pid_file: Path, extra: str = "") -> str:
    """A test sshd's configuration: key login only (``keys`` holds ``host_key`` and ``authorized_keys``),
    root allowed, no PAM, listening on ``address:port`` alone; ``extra``: more lines."""
    return textwrap.dedent(f"""\
        Port {port}
        ListenAddress {address}
        HostKey {keys / 'host_key'}
        AuthorizedKeysFile {keys / 'authorized_keys'}
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PubkeyAuthentication yes
        PermitRootLogin prohibit-password
        StrictModes no
        UsePAM no
        PidFile {pid_file}
        LogLevel ERROR
    """) + extra


def sweep_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (a test run killed before
    its tear-down); returns their names."""
    out = admin("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    # a namespace deleted by hand (or by a crashed tear-down) can leave its /etc/netns folder (hosts, resolv.conf)
    names += [n for n in (os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []) if n not in names]
    swept = []
    for name in names:
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit() or psutil.pid_exists(int(parts[1])):
            continue
        for pid in admin("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(pid)).kill()
        admin("ip", "netns", "del", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        swept.append(name)
    return swept


@contextlib.contextmanager
def cluster(n: int, *, rate: str | None = None, data_network: bool = False,
            loopback_names: bool = False, ipv6_only: bool = False) -> Iterator[Cluster]:
    """``n`` hosts on a bridge (see the module's docstring), torn down when the block ends, also on
    failure. ``rate``: every link limited to it (tc's syntax, e.g. ``1gbit``); ``data_network``: a
    second NIC per host (``eth1``, 10.213.1.0/24, names ``nodeN-data``) on a bridge of its own;
    ``loopback_names``: each host resolves its own name to 127.0.1.1 (Debian's /etc/hosts); ``ipv6_only``:
    the hosts' NICs have IPv6 addresses alone (fd00:213::/64, and each NIC's link-local fe80:: one), and
    their names resolve to those (loopback keeps 127.0.0.1 and ::1), as on a single-stack IPv6 network."""
    if ipv6_only and (data_network or loopback_names):
        raise ValueError("ipv6_only hosts have one network and names that resolve to it")
    sweep_stale()
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpucomm-cluster-") as tmp:
        c = Cluster(f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}", Path(tmp), data_network, rate, loopback_names,
                    ipv6_only)
        try:
            _keys(c.tmp)
            c._make_switch()
            for _ in range(n):
                c.add_host(probe=False)
            c.wait_for_ssh(c.hosts)
            c.start_seconds = time.monotonic() - t0
            yield c
        finally:
            c.close()


__all__ = ["Cluster", "ClusterError", "Host", "Watched", "admin", "cluster", "netns_selected", "require_netns",
           "sweep_stale", "unavailable"]
