"""gpucomm-run's pure parts: host lists, hostfiles, slot assignment, worker environment, flags."""

from __future__ import annotations

import shlex

import pytest

from gpucomm.runner.cli import build_parser, tunables_env
from gpucomm.bootstrap.placement import Placement
from gpucomm.runner.hosts import HostSlots, HostSpecError, assign_slots, parse_hostfile, parse_hostfile_text, \
    parse_hosts
from gpucomm.runner.remote import encode_request
from gpucomm.runner.spawn import SshOptions, build_launches, is_local, split_user, ssh_argv
from gpucomm.runner.worker_env import forwarded_env, job_env, worker_env
from gpucomm.bootstrap.world import detect_world

# ---------------------------------------------------------------- host lists


def test_parse_hosts_with_and_without_slots():
    assert parse_hosts("a:2,b:4,c") == [HostSlots("a", 2), HostSlots("b", 4), HostSlots("c", 1)]
    assert parse_hosts("user@node1:3") == [HostSlots("user@node1", 3)]
    assert parse_hosts("[::1]:2,10.0.0.1:1") == [HostSlots("[::1]", 2), HostSlots("10.0.0.1", 1)]
    # a login before a bracketed address (before: "put an IPv6 address in brackets", although it was; helper-63)
    assert parse_hosts("user@[fd00::2]:2,user@[::1]") == [HostSlots("user@[fd00::2]", 2), HostSlots("user@[::1]", 1)]


@pytest.mark.parametrize("spec, words", [
    ("a:0", "positive integer"), ("a:x", "positive integer"), ("a:2,a:3", "listed twice"),
    ("", "no hosts"), ("a:1:2", "IPv6"), ("[::1:2", "without closing"), ("a b:2", "not a host name"),
])
def test_parse_hosts_rejects_bad_specs(spec, words):
    with pytest.raises(HostSpecError, match=words):
        parse_hosts(spec)


def test_hostfile_formats_and_comments(tmp_path):
    text = "# cluster\nnode1 slots=2\n\nnode2 slots=4 max_slots=8  # big one\nnode3:3\nnode4\n"
    expected = [HostSlots("node1", 2), HostSlots("node2", 4), HostSlots("node3", 3), HostSlots("node4", 1)]
    assert parse_hostfile_text(text) == expected
    path = tmp_path / "hosts"
    path.write_text(text)
    assert parse_hostfile(path) == expected


@pytest.mark.parametrize("text, words", [
    ("node1 slots=0", "positive integer"), ("node1 cpus=2", "node1 slots=4"), ("node1 slots=2\nnode1 slots=1", "twice"),
    ("# only a comment\n", "no hosts"),
])
def test_hostfile_errors_name_the_line(text, words):
    with pytest.raises(HostSpecError, match=words):
        parse_hostfile_text(text, "hf")


def test_missing_hostfile_names_the_path(tmp_path):
    with pytest.raises(HostSpecError, match="cannot read hostfile .*nope"):
        parse_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------- slot assignment


def test_slots_fill_hosts_in_order():
    slots = assign_slots([HostSlots("h1", 2), HostSlots("h2", 2)], 4)
    assert slots == [Placement("h1", 0, 4, 0, 2, 0, 2), Placement("h1", 1, 4, 1, 2, 0, 2),
                     Placement("h2", 2, 4, 0, 2, 1, 2), Placement("h2", 3, 4, 1, 2, 1, 2)]


def test_slots_uneven_hosts_follow_horovod_cross_rank():
    # h1 runs 3 ranks, h2 one: local rank 0 exists on both hosts, local ranks 1 and 2 only on h1
    slots = assign_slots([HostSlots("h1", 3), HostSlots("h2", 4)], 4)
    assert [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("h1", 0, 3, 0, 2), ("h1", 1, 3, 0, 1), ("h1", 2, 3, 0, 1), ("h2", 0, 1, 1, 2)]


def test_slots_skip_hosts_not_needed():
    slots = assign_slots([HostSlots("h1", 4), HostSlots("h2", 4)], 3)
    assert {s.host for s in slots} == {"h1"} and all(s.local_size == 3 and s.cross_size == 1 for s in slots)


@pytest.mark.parametrize("hosts, np", [
    ([HostSlots("a", 1), HostSlots("b", 2), HostSlots("c", 3)], 6),
    ([HostSlots("a", 4), HostSlots("b", 1), HostSlots("c", 4)], 7),
    ([HostSlots("a", 8)], 5),
])
def test_slots_invariants(hosts, np):
    slots = assign_slots(hosts, np)
    assert [s.rank for s in slots] == list(range(np))
    for host in {s.host for s in slots}:
        mine = [s for s in slots if s.host == host]
        assert [s.local_rank for s in mine] == list(range(len(mine)))
        assert all(s.local_size == len(mine) for s in mine)
    for lr in {s.local_rank for s in slots}:
        peers = [s for s in slots if s.local_rank == lr]
        assert [s.cross_rank for s in peers] == list(range(len(peers)))
        assert all(s.cross_size == len(peers) for s in peers)


def test_too_many_ranks_is_a_clear_error():
    with pytest.raises(HostSpecError, match=r"-np 5 asks for more processes than the 4 slots available \(a:1, b:3\)"):
        assign_slots([HostSlots("a", 1), HostSlots("b", 3)], 5)
    with pytest.raises(HostSpecError, match="at least one"):
        assign_slots([HostSlots("a", 1)], 0)


# ---------------------------------------------------------------- worker environment


def test_job_env_round_trips_through_world_detection():
    secret = bytes(range(32))
    for slot in assign_slots([HostSlots("n1", 2), HostSlots("n2", 1)], 3):
        env = job_env(slot, rendezvous_addr="10.1.2.3", rendezvous_port=4567, secret=secret, run_id="abc")
        world = detect_world(env)
        assert (world.rank, world.size, world.local_rank, world.local_size, world.cross_rank, world.cross_size) == \
            (slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size)
        assert (world.launcher, world.hostname, world.rendezvous_addr, world.rendezvous_port) == \
            ("gpucomm", slot.host, "10.1.2.3", 4567)
        assert world.secret == secret and world.rendezvous_hosted and world.run_id == "abc"
        assert env["HOROVOD_RANK"] == str(slot.rank) and env["HOROVOD_CROSS_SIZE"] == str(slot.cross_size)
        assert env["PYTHONUNBUFFERED"] == "1"


def test_remote_env_drops_login_variables_but_keeps_paths():
    base = {"PATH": "/opt/bin", "PYTHONPATH": "/src", "LD_LIBRARY_PATH": "/cuda", "NCCL_DEBUG": "INFO",
            "HOME": "/home/me", "HOSTNAME": "login1", "SSH_CONNECTION": "x", "BASH_FUNC_f%%": "()", "PWD": "/x"}
    assert forwarded_env(base) == {"PATH": "/opt/bin", "PYTHONPATH": "/src", "LD_LIBRARY_PATH": "/cuda",
                                   "NCCL_DEBUG": "INFO"}


def test_job_variables_win_over_inherited_and_tunables():
    slot = assign_slots([HostSlots("h", 2)], 2)[1]
    env = worker_env({"GPUCOMM_RANK": "7", "X": "1"}, slot, {"GPUCOMM_SIZE": "9", "GPUCOMM_TIMEOUT": "5"},
                     remote=False, rendezvous_addr="a", rendezvous_port=1, secret=b"k" * 16, run_id="r")
    assert env["GPUCOMM_RANK"] == "1" and env["GPUCOMM_SIZE"] == "2" and env["GPUCOMM_TIMEOUT"] == "5"
    assert env["X"] == "1"


def test_secret_is_never_on_a_command_line():
    secret = bytes.fromhex("ab" * 32)
    slots = assign_slots([HostSlots("localhost", 1), HostSlots("user@far", 1)], 2)
    launches = build_launches(slots, ["python", "train.py"], {"PATH": "/bin"}, {}, rendezvous_addr=lambda host: "10.0.0.1",
                              rendezvous_port=99, secret=secret, run_id="r", cwd="/work",
                              ssh=SshOptions(port=2222, identity_file="/k"), grace=3.0)
    local, remote = launches
    assert not local.remote and local.argv == ["python", "train.py"] and local.env["GPUCOMM_SECRET"] == secret.hex()
    assert remote.remote and remote.argv[0] == "ssh" and "user@far" in remote.argv
    assert secret.hex() not in " ".join(local.argv + remote.argv)
    assert secret.hex() not in " ".join(f"{k}={v}" for k, v in remote.env.items())  # the ssh client's own env
    assert secret.hex().encode() in remote.stdin_payload  # it travels on the wrapper's stdin
    assert b'"cwd": "/work"' in remote.stdin_payload
    assert remote.stdin_payload == encode_request(["python", "train.py"], "/work", _payload_env(remote), 3.0)


def _payload_env(launch):
    import json

    return json.loads(launch.stdin_payload)["env"]


def test_remote_env_carries_hostname_without_login():
    slots = assign_slots([HostSlots("user@far", 1)], 1)
    (launch,) = build_launches(slots, ["x"], {}, {}, rendezvous_addr=lambda host: "a", rendezvous_port=1, secret=b"s" * 16,
                               run_id="r", cwd="/", ssh=SshOptions(), grace=1.0)
    assert _payload_env(launch)["GPUCOMM_HOSTNAME"] == "far"


def test_ssh_argv_options():
    argv = ssh_argv("node1", SshOptions(port=2200, identity_file="/id", connect_timeout=7.5, python="/py/bin/python3",
                                        extra_args=("-J", "gw")))
    assert argv[:1] == ["ssh"] and "BatchMode=yes" in argv and "ConnectTimeout=7" in argv
    assert argv[argv.index("-p") + 1] == "2200" and argv[argv.index("-i") + 1] == "/id"
    assert argv[argv.index("-J") + 1] == "gw"
    assert argv[-2] == "node1" and shlex.split(argv[-1])[-3:] == ["/py/bin/python3", "-m", "gpucomm.runner.remote"]


def test_local_host_names():
    import socket

    assert is_local("localhost") and is_local("127.0.0.1") and is_local(socket.gethostname())
    assert not is_local("some-other-node") and not is_local("me@localhost")
    assert split_user("me@node") == ("me", "node") and split_user("node") == (None, "node")


# ---------------------------------------------------------------- flags


def _tunables(*argv: str, env=None):
    args = build_parser().parse_args([*argv, "python", "x.py"])
    return tunables_env(args, env or {})


def test_tunable_flags_become_environment():
    env = _tunables("-np", "2", "--fusion-threshold-mb", "32", "--timeline-filename", "tl.json", "--timeout", "42",
                    "--start-timeout", "9", "--log-level", "debug", "--single-gpu-test", "--cpu-affinity",
                    "--network-interface", "eth1,eth0")
    assert env["GPUCOMM_FUSION_THRESHOLD"] == env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 2**20)
    assert env["GPUCOMM_TIMELINE"].endswith("/tl.json") and env["GPUCOMM_TIMELINE"].startswith("/")
    assert env["GPUCOMM_TIMEOUT"] == env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "42"
    assert env["GPUCOMM_START_TIMEOUT"] == env["HOROVOD_START_TIMEOUT"] == "9"
    assert env["GPUCOMM_LOG_LEVEL"] == "DEBUG" and env["GPUCOMM_SINGLE_GPU_TEST"] == "1"
    assert env["GPUCOMM_CPU_AFFINITY"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth1,eth0" and env["GPUCOMM_GLOO_IFACE"] == env["HOROVOD_GLOO_IFACE"] == "eth1"


def test_start_timeout_defaults_from_environment():
    assert _tunables("-np", "1")["GPUCOMM_START_TIMEOUT"] == "120"
    assert _tunables("-np", "1", env={"HOROVOD_START_TIMEOUT": "33"})["GPUCOMM_START_TIMEOUT"] == "33"


def test_command_keeps_its_own_flags():
    args = build_parser().parse_args(["-np", "2", "-H", "a:2", "python", "train.py", "-np", "7", "--verbose"])
    assert args.np == 2 and args.hosts == "a:2" and not args.verbose
    assert args.command == ["python", "train.py", "-np", "7", "--verbose"]


@pytest.mark.parametrize("argv", [["-np", "0", "x"], ["-np", "two", "x"], ["--timeout", "-1", "-np", "1", "x"],
                                  ["-H", "a:1", "--hostfile", "f", "-np", "1", "x"]])
def test_bad_flags_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
