"""Multi-host jobs for real (issue 37): ``gpucomm-run`` over ssh between hosts made of network
namespaces (``tests/cluster.py``), each with its own address, host name and sshd.

The namespace tests carry the ``netns`` marker and run in their own step (``pytest -m netns``, as
root; ``.ci/run`` does it); elsewhere they skip with the reason. The checks of the pieces they rely
on (which hosts are this one, the ssh command, the remote wrapper's heartbeat, keepalive) run
everywhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpucomm.bootstrap.keepalive import bound_dead_peer, keepalive_options
from gpucomm.bootstrap.netaddr import interface_of, local_addresses, resolves_here
from gpucomm.runner.cli import chosen_nic, remote_silence
from gpucomm.runner.remote import BEAT_S, SERVER_ALIVE_COUNT, SERVER_ALIVE_S, encode_request
from gpucomm.runner.spawn import SshOptions, is_local, ssh_argv
from gpucomm.settings import DEFAULT_LIVENESS_S, liveness_seconds
from tests.cluster import CLUSTER_NET6, SSH_OPTIONS, Cluster, admin, cluster, require_netns
from tests.harness import PYTHON, free_port, launcher_cmd, run, run_rank_scripts, started
from tests.ranks import netfault_job, partition_job

NETFAULT = str(Path(netfault_job.__file__))
PARTITION = str(Path(partition_job.__file__))
netns = pytest.mark.netns


@pytest.fixture
def hosts_allowed(request):
    """Skips the test (saying why) unless namespace hosts were asked for and can be made here."""
    require_netns(request.config)


def gpucomm_run(c: Cluster, *flags: str, command: tuple[str, ...], env: dict[str, str] | None = None,
                timeout: float = 180.0, ssh: bool = True):
    """``gpucomm-run FLAGS python COMMAND`` on the first host, with the cluster's ssh key (``ssh``;
    under ``--mpi`` the MPI launcher's own options carry it)."""
    keys = c.launcher_flags() if ssh else []
    return c.run(c.hosts[0], launcher_cmd(*flags, *keys, PYTHON, *command), env=env, timeout=timeout)


def placed(stdout: str) -> dict[int, str]:
    """Each rank's ``placed ...`` line (tests/ranks/netfault_job.py), by rank."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"placed rank (\d+)/.*", stdout)}


def sockets(stdout: str) -> dict[int, dict]:
    return {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"sockets rank (\d+): (\{.*\})", stdout)}


# ------------------------------------------------------------------------------------------ the pieces


def ipv6_loopback() -> bool:
    """Whether this machine has IPv6 loopback (::1 can be bound): not where IPv6 is switched off."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="IPv6 is switched off here (::1 cannot be bound)")


@needs_ipv6
def test_addresses_of_either_family(tmp_path):
    """The address pieces take IPv6 as they take IPv4: the route towards an IPv6 address is IPv6 (IPv4 where a
    name has both), a listener takes its address's family (``::`` both), and ``[addr]:port`` is how one is
    written. Before, the bootstrap was IPv4 only (helper-63 found it in IPv6-only namespace hosts)."""
    from gpucomm.bootstrap.netaddr import address_towards, host_port, is_ipv6, listening_socket

    assert address_towards("::1") == "::1" and address_towards("[::1]") == "::1"
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"  # (IPv4 first, where a name has both)
    assert is_ipv6("fd00::2") and is_ipv6("[fd00::2]") and is_ipv6("fe80::1%eth0") and not is_ipv6("10.0.0.1")
    assert not is_ipv6("node1")
    assert host_port("fd00::2", 29500) == "[fd00::2]:29500" and host_port("10.0.0.1", 1) == "10.0.0.1:1"
    for host, family, reach in (("::1", socket.AF_INET6, ["::1"]), ("127.0.0.1", socket.AF_INET, ["127.0.0.1"]),
                                ("::", socket.AF_INET6, ["::1", "127.0.0.1"])):
        with listening_socket(host, 0, backlog=4) as listener:
            assert listener.family == family
            for address in reach:  # (``::``: IPv4 clients too, through the dual stack)
                with socket.create_connection((address, listener.getsockname()[1]), timeout=5):
                    pass


@needs_ipv6
def test_a_job_whose_rendezvous_address_is_ipv6_runs(tmp_path):
    """A 2-rank job told an IPv6 rendezvous address (``::1``; ``[::1]`` as in a URL) meets and reduces: rank 0
    serves its store there. Before, rank 0 failed with 'cannot resolve' (or, after 18bd242, every rank refused
    IPv6 at once)."""
    script = tmp_path / "allreduce.py"
    script.write_text("import torch\nimport gpucomm.torch as hvd\nhvd.init()\n"
                      "t = hvd.allreduce(torch.ones(4) * (hvd.rank() + 1), op=hvd.Sum)\n"
                      "print(f'RANK {hvd.rank()} SUM {t.tolist()}', flush=True)\nhvd.shutdown()\n")
    for address in ("::1", "[::1]"):
        results = run_rank_scripts([str(script)], 2, store_on_rank0=True, timeout=90,
                                   env={"GPUCOMM_RENDEZVOUS_ADDR": address, "GPUCOMM_START_TIMEOUT": "30"})
        for r, res in enumerate(results):
            assert res.returncode == 0, (address, r, res.stdout, res.stderr[-3000:])
            assert f"RANK {r} SUM [3.0, 3.0, 3.0, 3.0]" in res.stdout, (address, res.stdout)


@needs_ipv6
def test_listening_on_both_families_falls_back_only_where_ipv6_is_off(monkeypatch):
    """``::`` falls back to every IPv4 interface only where the kernel has no IPv6; a port held by another
    IPv6 listener is the caller's error, not a silent IPv4-only store. And where IPv6 sockets cannot even be
    made (a kernel booted with ipv6.disable=1), the route lookup still answers (it raised OSError: helper-67)."""
    from gpucomm.bootstrap import netaddr

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        held.bind(("::", 0))
        held.listen()
        with pytest.raises(OSError) as e:
            netaddr.listening_socket("::", held.getsockname()[1], backlog=4).close()
        assert e.value.errno == errno.EADDRINUSE
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)
    assert netaddr.address_towards("::1") not in ("", None)  # (no route that way: this host's own name's address)
    assert netaddr.address_for_peers("127.0.0.1") == "127.0.0.1"
    with netaddr.listening_socket("::", 0, backlog=4) as listener:
        assert listener.family == socket.AF_INET


@needs_ipv6
def test_addresses_mpi_and_a_rank_0_cannot_serve_are_refused_with_the_reason():
    """An IPv6 address in an MPI host list (Open MPI splits host:slots at the first ':'), an IPv6 link-local
    rendezvous address (meaningless without an interface name, which differs between hosts), and a bind address
    of the other family than the rendezvous address's."""
    from gpucomm.bootstrap.arrival import bind_address
    from gpucomm.errors import GpucommError
    from gpucomm.runner.mpi_launch import MpiLaunchError, host_list

    assert host_list(["node0", "node0", "node1"]) == "node0:2,node1:1"
    with pytest.raises(MpiLaunchError, match=r"host '\[fd00::2\]': MPI launchers take no IPv6 address"):
        host_list(["node0", "[fd00::2]"])
    with pytest.raises(GpucommError, match=r"'fe80::1%lo' is IPv6 link-local \(fe80::1\)"):
        bind_address("fe80::1%lo", all_local=False)
    # GPUCOMM_RENDEZVOUS_BIND of one family for an address of the other (each rank waited out the start timeout)
    with pytest.raises(GpucommError, match=r"GPUCOMM_RENDEZVOUS_BIND=0.0.0.0 listens on IPv4 only, but the rendezvous "
                                           r"address '::1' is reached over IPv6 alone"):
        bind_address("::1", all_local=False, override="0.0.0.0")
    with pytest.raises(GpucommError, match=r"=::1 listens on IPv6 only, but .* '127.0.0.1' is reached over IPv4 alone"):
        bind_address("127.0.0.1", all_local=False, override="::1")
    assert bind_address("::1", all_local=False, override="::") == "::"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gloo_interface_one_host_lacks_fails_every_rank_at_init_naming_it(tmp_path, rank):
    """GPUCOMM_GLOO_IFACE names an interface one host does not have (names differ between hosts: eth0, ens5). Before,
    that rank failed alone in Gloo and the others waited out GPUCOMM_TIMEOUT for its Gloo keys ('1 of 1 keys were
    not set ... /gloo/0/0'); now every rank fails at init(), naming the rank, the interface and the host."""
    script = tmp_path / "init.py"
    script.write_text(f"import os, sys\nif os.environ['GPUCOMM_RANK'] == '{rank}':\n"
                      f"    os.environ['GPUCOMM_GLOO_IFACE'] = 'nonexistent0'\n"
                      "import gpucomm.torch as hvd\ntry:\n    hvd.init()\nexcept Exception as e:\n"
                      "    print(f'RANK {os.environ[\"GPUCOMM_RANK\"]} ERROR {type(e).__name__}: {e}', flush=True)\n"
                      "    sys.exit(3)\n")
    results = run_rank_scripts([str(script)], 2, timeout=90, env={"GPUCOMM_TIMEOUT": "10"})
    lacks = "the network interface 'nonexistent0' (GPUCOMM_GLOO_IFACE / HOROVOD_GLOO_IFACE) does not exist on this host"
    for r, res in enumerate(results):
        assert res.returncode == 3, (r, res.stdout, res.stderr)
        told = res.stdout
        assert lacks in told and f"This is host {socket.gethostname()}" in told, told
        if r != rank:
            assert f"ERROR GpucommError: rank {rank} failed in gpucomm.init(): InterfaceError: " in told, told
    assert results[0].leftovers == []


def test_addresses_of_this_host_are_local_and_others_are_remote():
    mine = sorted(a for a in local_addresses() if ":" not in a)
    assert "127.0.0.1" in mine
    for address in mine:
        assert is_local(address), address
    assert is_local("localhost") and resolves_here("localhost")
    assert not is_local("192.0.2.1")  # TEST-NET-1: never this host's
    assert not is_local("no-such-host.invalid") and not resolves_here("no-such-host.invalid")
    assert not is_local("root@127.0.0.1")  # a login always goes through ssh
    assert interface_of("127.0.0.1") is not None and interface_of("192.0.2.1") is None


def test_ssh_args_come_first_so_that_the_user_overrides_the_defaults():
    argv = ssh_argv("node1", SshOptions(extra_args=("-o", "StrictHostKeyChecking=no", "-o", "ServerAliveInterval=3")))
    assert argv[1:5] == ["-o", "StrictHostKeyChecking=no", "-o", "ServerAliveInterval=3"]  # ssh keeps the first value
    assert f"ServerAliveInterval={SERVER_ALIVE_S}" in argv and f"ServerAliveCountMax={SERVER_ALIVE_COUNT}" in argv
    # the launcher's ssh gives up on a silent host only after the ranks' liveness check has named it
    assert SERVER_ALIVE_S * SERVER_ALIVE_COUNT > DEFAULT_LIVENESS_S


def test_liveness_default_and_the_remote_wrappers_limit():
    assert liveness_seconds({}) == DEFAULT_LIVENESS_S == 20.0
    assert liveness_seconds({"GPUCOMM_TIMEOUT": "16"}) == 8.0 and liveness_seconds({"GPUCOMM_TIMEOUT": "4"}) == 5.0
    assert liveness_seconds({"GPUCOMM_LIVENESS_TIMEOUT": "0"}) is None
    assert remote_silence({}) == 40.0 and remote_silence({"GPUCOMM_LIVENESS_TIMEOUT": "0"}) is None
    assert json.loads(encode_request(["x"], "/", {}, 1.0, 40.0))["silence"] == 40.0
    assert "silence" not in json.loads(encode_request(["x"], "/", {}, 1.0))  # no heartbeats promised: none expected


def test_the_chosen_interface_comes_from_the_flag_or_the_environment():
    assert chosen_nic({"GPUCOMM_GLOO_IFACE": "eth1"}, {"GPUCOMM_GLOO_IFACE": "eth2"}) == "eth1"
    assert chosen_nic({}, {"HOROVOD_GLOO_IFACE": "eth2"}) == "eth2"
    assert chosen_nic({}, {"NCCL_SOCKET_IFNAME": "eth3"}) is None  # NCCL's own variable stays NCCL's


def test_keepalive_bounds_a_dead_peer():
    with socket.socket() as sock:
        bound_dead_peer(sock, 20.0)
        for level, option, value in keepalive_options(20.0):
            assert sock.getsockopt(level, option) == value
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20000


def test_the_remote_wrapper_stops_its_rank_when_the_launcher_falls_silent(tmp_path):
    """No heartbeat on stdin for ``silence`` s (the launcher's host dropped off the network: no EOF
    ever comes): the wrapper stops the rank and says why."""
    request = encode_request([PYTHON, "-c", "import time; time.sleep(600)"], str(tmp_path), dict(os.environ), 1.0,
                             silence=1.5)
    with started([PYTHON, "-m", "gpucomm.runner.remote"], stdin=subprocess.PIPE, text=False, timeout=120) as wrapper:
        wrapper.proc.stdin.write(request)
        wrapper.proc.stdin.flush()
        t0 = time.monotonic()
        wrapper.proc.wait(timeout=60)  # stdin stays open (no EOF): only the silence can stop it
        took = time.monotonic() - t0
        err = wrapper.proc.stderr.read()
    assert b"nothing heard from gpucomm-run for 1.5 s" in err and b"unreachable" in err, err
    assert wrapper.proc.returncode == 128 + 15  # the rank got SIGTERM
    assert wrapper.leftovers == []
    print(f"\nremote wrapper: rank stopped {took:.1f} s after its last heartbeat (limit 1.5 s; beats every {BEAT_S:g} s)")


def test_the_remote_wrapper_keeps_a_rank_that_hears_heartbeats(tmp_path):
    request = encode_request([PYTHON, "-c", "import time; time.sleep(2.5)"], str(tmp_path), dict(os.environ), 1.0,
                             silence=1.0)
    with started([PYTHON, "-m", "gpucomm.runner.remote"], stdin=subprocess.PIPE, text=False, timeout=120) as wrapper:
        wrapper.proc.stdin.write(request)
        wrapper.proc.stdin.flush()
        deadline = time.monotonic() + 60
        while wrapper.proc.poll() is None and time.monotonic() < deadline:
            wrapper.proc.stdin.write(b"\n")
            wrapper.proc.stdin.flush()
            time.sleep(0.2)
        assert wrapper.proc.wait(timeout=10) == 0, wrapper.proc.stderr.read()


# ------------------------------------------------------------------------------------------ the fixture


@netns
@pytest.mark.parametrize("n", [2, 4])
def test_the_fixture_starts_and_stops_n_hosts(hosts_allowed, n):
    with cluster(n) as c:
        made = c.start_seconds
        names = [h.netns for h in c.hosts] + [c.switch]
        sshd = [h.sshd.proc.pid for h in c.hosts]
        for h in c.hosts:
            r = c.run(c.hosts[0], c.ssh_argv(h, "hostname; ip -4 -o addr show dev eth0"), timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split()[0] == h.name and f"{h.address}/24" in r.stdout
    listed = admin("ip", "netns", "list").stdout
    assert not [name for name in names if name in listed]
    assert not [name for name in names if os.path.exists(f"/etc/netns/{name}")]
    assert not [pid for pid in sshd if _running(pid)]
    print(f"\nfixture, {n} hosts: started (namespaces, links, sshd, first ssh login to each) in {made:.2f} s, "
          f"stopped in {c.stop_seconds:.2f} s")


@netns
def test_the_fixture_tears_everything_down_when_a_test_fails(hosts_allowed):
    with pytest.raises(RuntimeError, match="the test failed"):
        with cluster(2) as c:
            names = [h.netns for h in c.hosts] + [c.switch]
            # a process that escaped its ssh session: only the namespace says it is the test's
            r = c.run(c.hosts[0], c.ssh_argv(c.hosts[1], "setsid sleep 600 </dev/null >/dev/null 2>&1 &"), timeout=60)
            assert r.returncode == 0, r.stderr
            escaped = [pid for pid in c.pids(c.hosts[1]) if _cmdline(pid) == "sleep 600"]
            assert escaped
            raise RuntimeError("the test failed")
    assert not [pid for pid in escaped if _running(pid)]
    listed = admin("ip", "netns", "list").stdout
    assert not [name for name in names if name in listed]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ placement


@netns
def test_hosts_by_name_ranks_local_and_cross_ranks_agree_with_the_placement(hosts_allowed):
    with cluster(2) as c:
        r = gpucomm_run(c, "-np", "4", "-H", "node0:2,node1:2", "--verbose", command=("examples/hello_allreduce.py",))
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    for rank, (local, cross, host) in enumerate([("0/2", "0/2", "node0"), ("1/2", "0/2", "node0"),
                                                 ("0/2", "1/2", "node1"), ("1/2", "1/2", "node1")]):
        assert f"[{rank}]<stdout>:rank {rank}/4 local {local} cross {cross} on {host} (cpu)" in r.stdout, r.stdout
    assert "allreduce over 4 ranks OK" in r.stdout
    # the launcher's own host runs its ranks directly; the other host through ssh
    assert re.search(r"rank 1: host node0 local 1/2 cross 0/2\n", r.stderr), r.stderr
    assert "rank 2: host node1 local 0/2 cross 1/2 (ssh)" in r.stderr
    assert r.leftovers == [] and left == []


@netns
def test_a_hostfile_of_addresses_with_an_uneven_layout(hosts_allowed, tmp_path):
    """Addresses, not names; the launcher's own address runs locally (Horovod's rule: an address of
    one of this host's interfaces); 1 + 2 + 1 slots make local and cross ranks differ."""
    hostfile = tmp_path / "hosts"
    with cluster(3) as c:
        hostfile.write_text("".join(f"{h.address} slots={s}\n" for h, s in zip(c.hosts, (1, 2, 1))))
        r = gpucomm_run(c, "-np", "4", "--hostfile", str(hostfile), "--verbose", command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1"})
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    want = {0: "placed rank 0/4 local 0/1 cross 0/3 on 10.213.0.2", 1: "placed rank 1/4 local 0/2 cross 1/3 on 10.213.0.3",
            2: "placed rank 2/4 local 1/2 cross 0/1 on 10.213.0.3", 3: "placed rank 3/4 local 0/1 cross 2/3 on 10.213.0.4"}
    got = placed(r.stdout)
    for rank, line in want.items():
        assert got[rank].startswith(line), (rank, got)
    assert "started rank 0 (local" in r.stderr and "started rank 1 (ssh to 10.213.0.3" in r.stderr
    assert r.leftovers == [] and left == []


# ------------------------------------------------------------------------------------------ interfaces


@netns
@pytest.mark.parametrize("how", ["--network-interface", "GPUCOMM_GLOO_IFACE", "HOROVOD_GLOO_IFACE"])
def test_the_chosen_interface_carries_all_of_the_jobs_traffic(hosts_allowed, how):
    """Two networks; ssh and the host names are on eth0, the job is told eth1: the store, rank 0's
    control listener and Gloo listen only on eth1 addresses and every connection of every rank goes
    to one (a rank's sockets, read with psutil)."""
    flags = ["--network-interface", "eth1"] if how.startswith("--") else []
    env = {"NETFAULT_SECONDS": "1"} | ({} if flags else {how: "eth1"})
    with cluster(3, data_network=True) as c:
        r = gpucomm_run(c, "-np", "3", "-H", "node0:1,node1:1,node2:1", "--verbose", *flags, command=(NETFAULT,), env=env)
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(r"rendezvous store at 10\.213\.1\.2:\d+", r.stderr), r.stderr
    seen = sockets(r.stdout)
    assert sorted(seen) == [0, 1, 2]
    for rank, where in seen.items():
        addresses = where["listen"] + where["local"] + where["peers"]
        assert addresses and all(a.startswith("10.213.1.") for a in addresses), (rank, where)
    if flags:
        assert all(line.endswith("NCCL_SOCKET_IFNAME=eth1") for line in placed(r.stdout).values())
    assert r.leftovers == [] and left == []


@netns
def test_without_a_chosen_interface_gloo_binds_the_route_to_the_store_not_loopback(hosts_allowed):
    """Each host's name resolves to 127.0.1.1 (Debian's /etc/hosts). Gloo's own choice would then
    listen on loopback and send the other hosts there (connectFullMesh ... remote=[127.0.1.1]);
    gpucomm gives it the interface on the route to the store."""
    with cluster(3, loopback_names=True) as c:
        r = gpucomm_run(c, "-np", "3", "-H", "node0:1,node1:1,node2:1", command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1"})
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    for rank, where in sockets(r.stdout).items():
        assert all(a.startswith("10.213.0.") for a in where["listen"] + where["local"] + where["peers"]), (rank, where)
    assert left == []


@netns
def test_a_process_set_across_hosts_whose_names_resolve_to_loopback(hosts_allowed):
    """A process set's own Gloo group listens where the world's does. Before, only the world's group was given
    the interface on the route to the store; a process set spanning hosts got Gloo's own choice, the address
    the host's name resolves to (127.0.1.1), and its first large allreduce failed ('Gloo connectFullMesh failed
    ... remote=[127.0.1.1]')."""
    with cluster(3, loopback_names=True) as c:
        r = gpucomm_run(c, "-np", "3", "-H", "node0:1,node1:1,node2:1", command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1", "NETFAULT_PROCESS_SET": "0,2"})
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    assert "process set rank 0 sum 4" in r.stdout and "process set rank 2 sum 4" in r.stdout, r.stdout[-3000:]
    for rank, where in sockets(r.stdout).items():
        assert all(a.startswith("10.213.0.") for a in where["listen"] + where["local"] + where["peers"]), (rank, where)
    assert left == []


@netns
def test_torchrun_across_hosts_whose_names_resolve_to_loopback(hosts_allowed):
    """torchrun's c10d rendezvous sets MASTER_ADDR to group rank 0's node's FQDN, which that node's /etc/hosts
    maps to 127.0.1.1 (Debian's default; torch's own store listens on every interface, so torch does not mind).
    Before, rank 0 served gpucomm's store, its control listener and Gloo on loopback and published 127.0.0.1, so
    the other node's rank waited for its own loopback until the start timeout (found by helper-61). Now rank 0
    takes the address other hosts reach it on (here the only one: these hosts have no default route). A rank's
    connection to torchrun's own store is torch's, to the address torchrun chose, so it is listed apart (CI once
    saw rank 0 still holding one at its 5th allreduce: '::ffff:127.0.0.1' to '::ffff:127.0.1.1')."""
    with cluster(2, loopback_names=True) as c:
        seen, left = torchrun_on_two_hosts(c, "loopback-names")
    for rank, where in seen.items():
        assert all(a.startswith("10.213.0.") for a in where["listen"] + where["local"] + where["peers"]), (rank, where)
    assert left == []


def torchrun_on_two_hosts(c: Cluster, rdzv_id: str) -> tuple[dict[int, dict], list[str]]:
    """tests/ranks/netfault_job.py under torchrun's c10d rendezvous (on node0), one rank on each of the cluster's
    two hosts: each rank's sockets (both ranks must have ended well) and the processes left behind."""
    argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"node0:{free_port()}", "--rdzv-id", rdzv_id, NETFAULT]
    env = {"NETFAULT_SECONDS": "1", "GPUCOMM_START_TIMEOUT": "40"}
    with c.watch(c.hosts[0], argv, env=env, timeout=150) as first, \
            c.watch(c.hosts[1], argv, env=env, timeout=150) as second:
        codes = (first.wait_exit(120), second.wait_exit(120))
        out = first.text() + second.text()
    left = c.leftovers()
    assert codes == (0, 0), out[-6000:]
    seen = sockets(out)
    assert sorted(seen) == [0, 1], out[-4000:]
    return seen, left


# ------------------------------------------------------------------------------------------ ssh aliases


@netns
def test_a_host_named_by_an_ssh_config_alias_reaches_the_store(hosts_allowed):
    """-H names a host by its ~/.ssh/config alias (Host peer1 / HostName 10.213.0.3), a name only ssh knows, on
    hosts whose own names resolve to 127.0.1.1. Before, gpucomm-run found no route towards 'peer1', fell back
    to its own name's address and served the store on 127.0.1.1: the rank on peer1 waited out the start timeout
    ('could not reach the gpucomm rendezvous store at 127.0.1.1'). Now the route is looked up towards the
    HostName ssh gives the alias (``ssh -G``). A name that neither resolves nor is an alias, where this host has
    no default route and two addresses to choose from, is refused before any rank starts."""
    with cluster(2, loopback_names=True, data_network=True) as c:
        config = c.tmp / "ssh_config"
        config.write_text(f"Host peer1\n    HostName {c.hosts[1].address}\n")
        flags = ["-i", c.key, "--ssh-args", " ".join([*SSH_OPTIONS, "-F", str(config)])]
        env = {"NETFAULT_SECONDS": "1", "GPUCOMM_START_TIMEOUT": "30"}
        r = c.run(c.hosts[0], launcher_cmd("-np", "2", "-H", "node0:1,peer1:1", "--verbose", *flags, PYTHON, NETFAULT),
                  env=env, timeout=120)
        unknown = c.run(c.hosts[0], launcher_cmd("-np", "2", "-H", "node0:1,nosuchhost:1", "--verbose", *flags, PYTHON,
                                                 NETFAULT),
                        env=env, timeout=60)
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rendezvous store at 10.213.0.2:" in r.stderr, r.stderr[-3000:]
    on_host = {rank: line.split(" on ")[1].split(":")[0] for rank, line in placed(r.stdout).items()}
    assert on_host == {0: "node0", 1: "peer1"}, r.stdout[-3000:]  # (the name the host list gives it)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr, unknown.stderr[-3000:]
    assert re.search(r"gpucomm-run: this host's address towards 'nosuchhost' is 127\.[\d.]+, a loopback address, which "
                     r"the ranks there cannot reach: 'nosuchhost' does not resolve here, and `ssh -G` gives no other "
                     r"HostName for it .* Fix: --network-interface IF", unknown.stderr), unknown.stderr[-3000:]
    assert "started rank" not in unknown.stderr, unknown.stderr[-3000:]  # (refused before any rank starts)
    assert left == []


def test_ssh_hostname_reads_an_alias_from_ssh_configuration(tmp_path):
    """``ssh -G`` gives an alias's HostName without connecting; a name that resolves is kept as it is."""
    from gpucomm.runner.spawn import ssh_hostname

    if shutil.which("ssh") is None:
        pytest.skip("OpenSSH's client is not installed")
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu-alias.invalid\n    HostName 192.0.2.44\n    User someone\n"
                      "Host tunnel.invalid\n    HostName localhost\n    Port 2222\n")
    opts = SshOptions(extra_args=("-F", str(config)))
    assert ssh_hostname("gpu-alias.invalid", opts) == "192.0.2.44"
    assert ssh_hostname("someone@gpu-alias.invalid", opts) == "192.0.2.44"
    assert ssh_hostname("tunnel.invalid", opts) == "localhost"
    assert ssh_hostname("localhost", opts) == "localhost"
    assert ssh_hostname("[::1]", opts) == "::1"
    assert ssh_hostname("not-an-alias.invalid", opts) == "not-an-alias.invalid"  # (ssh's HostName is the name itself)


# ------------------------------------------------------------------------------------------ IPv6


def on_cluster_net6(seen: dict[int, dict]) -> None:
    """Every gpucomm socket of every rank listens on, or connects between, the cluster's IPv6 addresses."""
    for rank, where in seen.items():
        addresses = where["listen"] + where["local"] + where["peers"]
        assert addresses and all(a.startswith(CLUSTER_NET6) for a in addresses), (rank, where)


@netns
@pytest.mark.parametrize("spelling", ["names", "addresses", "interface"])
def test_a_job_runs_across_ipv6_only_hosts(hosts_allowed, spelling):
    """Hosts with IPv6 addresses alone (a single-stack IPv6 network, as in an IPv6 Kubernetes cluster), named in
    /etc/hosts, written as bracketed addresses in -H (ssh is given them without the brackets), or with
    --network-interface eth0 (its global address, not its link-local fe80:: one): gpucomm-run's store, rank 0's
    control listener and Gloo take IPv6 addresses, and every connection of every rank is between them. Before,
    gpucomm-run refused the hosts (18bd242), and before that rank 0 failed with 'cannot resolve' while the others
    waited out the start timeout (helper-63)."""
    with cluster(3, ipv6_only=True) as c:
        hosts = ",".join(f"[{h.address}]:1" if spelling == "addresses" else f"{h.name}:1" for h in c.hosts)
        flags = ["--network-interface", "eth0"] if spelling == "interface" else []
        r = gpucomm_run(c, "-np", "3", "-H", hosts, "--verbose", *flags, command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1"})
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(rf"rendezvous store at \[{CLUSTER_NET6}2\]:\d+", r.stderr), r.stderr[-3000:]
    seen = sockets(r.stdout)
    assert sorted(seen) == [0, 1, 2], r.stdout[-3000:]
    on_cluster_net6(seen)
    assert r.leftovers == [] and left == []


@netns
@pytest.mark.parametrize("how", ["names", "interface"])
def test_an_ipv6_job_on_hosts_that_also_have_ipv4_stays_on_ipv6(hosts_allowed, how):
    """The hosts' names resolve to IPv6 alone, but node0 and node2 also have IPv4 on eth0 (node1 has none), and
    node0's eth0 an IPv4 link-local one too. Found by helper-69, each failing before: Gloo, given the interface
    on the route to the store, took its first address, the IPv4 one, and could not pair it with node1's IPv6
    one ('ss1.ss_family == ss2.ss_family. 2 vs 10'); with --network-interface eth0 the launcher served the store
    on that interface's IPv4 address, which node1 cannot reach, and its rank waited out the start timeout. Now
    the job stays in the family its hosts are reached in: every socket of every rank is on the IPv6 network."""
    with cluster(3, ipv6_only=True) as c:
        c.add_address(c.hosts[0], "169.254.10.2")
        c.add_address(c.hosts[0], "10.213.0.2")
        c.add_address(c.hosts[2], "10.213.0.4")
        flags = ["--network-interface", "eth0"] if how == "interface" else []
        r = gpucomm_run(c, "-np", "3", "-H", "node0:1,node1:1,node2:1", "--verbose", *flags, command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1", "NETFAULT_PROCESS_SET": "0,2", "GPUCOMM_START_TIMEOUT": "30"})
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(rf"rendezvous store at \[{CLUSTER_NET6}2\]:\d+", r.stderr), r.stderr[-3000:]
    on_cluster_net6(sockets(r.stdout))
    assert r.leftovers == [] and left == []


@netns
def test_hosts_reached_in_different_families_are_refused_before_any_rank_starts(hosts_allowed):
    """node1 is reached over IPv6 only and node2 over IPv4 only: no store and no Gloo pairing serves both. Before,
    the job started, and the ranks of one family waited out the start timeout for a store they could not reach
    (helper-69); now gpucomm-run refuses at once, naming the hosts of each family."""
    with cluster(3, ipv6_only=True) as c:
        c.add_address(c.hosts[0], "10.213.0.2")
        c.add_address(c.hosts[2], "10.213.0.4", name_it=True)
        r = gpucomm_run(c, "-np", "3", "-H", "node0:1,node1:1,node2:1", "--verbose", command=(NETFAULT,),
                        env={"NETFAULT_SECONDS": "1"}, timeout=60)
        left = c.leftovers()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("gpucomm-run: this host reaches node2 over IPv4 and node1 over IPv6 (its address on the route towards "
            "each)") in r.stderr, r.stderr[-3000:]
    assert "started rank" not in r.stderr and left == []


@netns
def test_torchrun_across_ipv6_only_hosts(hosts_allowed):
    """torchrun's c10d rendezvous on node0, whose name resolves to its IPv6 address alone: rank 0 serves
    gpucomm's store and control listener on its IPv6 address, and the other node's rank reaches them."""
    with cluster(2, ipv6_only=True) as c:
        seen, left = torchrun_on_two_hosts(c, "ipv6-only")
    on_cluster_net6(seen)
    assert left == []


@netns
def test_an_elastic_job_runs_across_ipv6_only_hosts(hosts_allowed, tmp_path):
    """The elastic launcher's store listens on every interface of both families (``::``), so workers on
    IPv6-only hosts reach it; the job runs its steps at 2 workers and ends."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("node1:1\nnode2:1\n")
    with cluster(3, ipv6_only=True) as c:
        cmd, env = elastic_partition_job(c, hosts_file, tmp_path, np=2, max_np=2, steps=20)
        r = c.run(c.hosts[0], cmd, env=env, timeout=180)
        left = c.leftovers()
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert json.loads((tmp_path / "result.json").read_text())["sizes"][-1] == 2
    assert left == []


# ------------------------------------------------------------------------------------------ MPI


def _openmpi() -> str | None:
    path = shutil.which("mpirun")
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return path if "Open MPI" in out.stdout + out.stderr else None


@netns
@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_mpi_launch_across_hosts(hosts_allowed, flavor, family):
    """``gpucomm-run --mpi`` across two hosts: MPICH's Hydra (the mpich wheel's mpiexec) or Open
    MPI's mpirun starts the ranks over ssh; the CPU collectives move through MPI. On IPv6-only hosts too, through
    Open MPI: gpucomm-run's store and rank channel listen on the IPv6 address towards the other host. MPICH's Hydra
    is IPv4 only (its proxies stopped with 'unable to get host address for node0'), so there gpucomm-run refuses
    at once, saying so and what to use instead."""
    env = {"NETFAULT_SECONDS": "2"}
    if flavor == "openmpi":
        path = _openmpi()
        if path is None:
            pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)")
        env["GPUCOMM_MPIEXEC"] = path
    with cluster(2, ipv6_only=family == "ipv6") as c:
        ssh = c.ssh_command()
        mpi_args = f"-launcher ssh -launcher-exec {ssh}" if flavor == "mpich" else f"--mca plm_rsh_agent {ssh}"
        r = gpucomm_run(c, "--mpi", "-np", "4", "-H", "node0:2,node1:2", "--mpi-args", mpi_args, command=(NETFAULT,),
                        env=env, timeout=240, ssh=False)
        left = c.leftovers()
    if family == "ipv6" and flavor == "mpich":
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-4000:]
        assert "the hosts reach this one over IPv6 only (this host is fd00:213::2 to them), and MPICH's Hydra" \
            in r.stderr, r.stderr[-4000:]
        assert r.leftovers == [] and left == []
        return
    assert r.returncode == 0, r.stderr[-4000:]
    got = placed(r.stdout)
    for rank, (local, cross, host) in enumerate([("0/2", "0/2", "node0"), ("1/2", "0/2", "node0"),
                                                 ("0/2", "1/2", "node1"), ("1/2", "1/2", "node1")]):
        assert got[rank].startswith(f"placed rank {rank}/4 local {local} cross {cross} on {host}: mpi"), got
    assert len(re.findall(r"done rank \d after", r.stdout)) == 4
    assert r.leftovers == [] and left == []


# ------------------------------------------------------------------------------------------ elastic


@netns
def test_an_elastic_job_gains_a_host_that_appears_and_loses_one_that_is_removed(hosts_allowed, tmp_path):
    """The discovery script lists the hosts that exist: a namespace made mid-job (node3) joins the
    job, and once the job has grown it is removed (its processes killed, its namespace deleted)."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("node1:1\nnode2:1\n")
    with cluster(3) as c:
        cmd, env = elastic_partition_job(c, hosts_file, tmp_path, np=2, max_np=3, steps=250)
        with c.watch(c.hosts[0], cmd, env=env, timeout=300) as job:
            job.wait_for(r"step 5 size 2")
            added_at = time.time()
            node3 = c.add_host()
            with open(hosts_file, "a") as f:
                f.write(f"{node3.name}:1\n")
            grown = job.wait_for(r"step \d+ size 3", timeout=120)[0][0]
            removed_at = time.time()
            c.remove_host(node3)
            hosts_file.write_text("node1:1\nnode2:1\n")
            # every size-2 step so far came before the growth: the next one is the first after the removal
            shrunk = job.wait_for(r"step \d+ size 2", count=1 + count_lines(job, r"step \d+ size 2"), timeout=120)[-1][0]
            code = job.wait_exit(180)
        left = c.leftovers()
    assert code == 0, job.text()[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    sizes = result["sizes"]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2 and sizes.index(3) < len(sizes) - sizes[::-1].index(3)
    assert left == [] and job.handle.proc.returncode == 0
    print(f"\nelastic over namespaces: host added -> first step at 3 workers {grown - added_at:.1f} s (a new "
          f"worker starts over ssh); host removed -> first step at 2 workers {shrunk - removed_at:.1f} s; "
          f"{result['resets']} resets")


def elastic_partition_job(c: Cluster, hosts_file: Path, out: Path, *, np: int, max_np: int,
                          steps: int) -> tuple[list[str], dict[str, str]]:
    """The launcher command and environment of an elastic job of tests/ranks/partition_job.py whose
    discovery script lists ``hosts_file`` (at least 2 workers, at most ``max_np``)."""
    cmd = launcher_cmd("-np", str(np), "--min-np", "2", "--max-np", str(max_np), "--host-discovery-script",
                       f"cat {hosts_file}", *c.launcher_flags(), PYTHON, PARTITION)
    return cmd, {"PARTITION_OUT": str(out), "PARTITION_STEPS": str(steps), "PARTITION_SLEEP": "0.1"}


def count_lines(job, pattern: str) -> int:
    """How many of a watched launcher's lines so far match ``pattern``."""
    rx = re.compile(pattern)
    return sum(1 for _, _, line in job.lines if rx.search(line))


# ------------------------------------------------------------------------------------------ benchmarks


@netns
def test_horovods_synthetic_benchmark_at_2_hosts_x_2_ranks(hosts_allowed):
    """examples/synthetic_benchmark.py (Horovod's flags and output) across two hosts whose links are
    limited to 1 Gbit/s, slower than memory."""
    args = ("--model", "cnn", "--no-cuda", "--batch-size", "16", "--num-warmup-batches", "2",
            "--num-batches-per-iter", "2", "--num-iters", "3")  # ResNet-50, its default, is too slow for 2 cores
    with cluster(2, rate="1gbit") as c:
        r = gpucomm_run(c, "-np", "4", "-H", "node0:2,node1:2", command=("examples/synthetic_benchmark.py", *args),
                        timeout=300)
        left = c.leftovers()
    assert r.returncode == 0, r.stderr[-4000:]
    total = re.search(r"Total img/sec on 4 CPU\(s\): [\d.]+ \+-[\d.]+", r.stdout)
    assert total, r.stdout[-3000:]
    assert left == []
    print(f"\nsynthetic benchmark, 2 hosts x 2 ranks over 1 Gbit/s links ({' '.join(args)}): {total.group(0)}")


@netns
def test_the_shaped_link_driver_fits_a_1_gbit_link(hosts_allowed, tmp_path):
    """benchmarks/shaped_links.py at its smallest (the rate fit alone, 1 Gbit/s, 3 allreduces per size):
    it builds its 2 hosts, shapes their links, fits, writes its JSON and leaves nothing behind. The
    fitted rate is only reported (a smoke run on a shared machine)."""
    r = run([PYTHON, "benchmarks/shaped_links.py", "--rates", "1gbit", "--probe-reps", "3",
             "--skip", "model_check,ddp,autotune", "--out-dir", str(tmp_path)], timeout=300)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert r.leftovers == [], r.leftovers
    doc = json.loads((tmp_path / "shaped_links.json").read_text())
    assert doc, r.stdout[-2000:]
    print(f"\nshaped-link smoke run:\n{r.stdout[-1500:]}")

