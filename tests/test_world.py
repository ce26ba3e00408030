"""Tests for gpucomm.bootstrap.world: launcher detection, parsing and validation (no I/O)."""

from __future__ import annotations

import dataclasses

import pytest

from gpucomm.bootstrap import world as W
from gpucomm.bootstrap.arrival import cross_placement
from gpucomm.bootstrap.slurm import SlurmSyntaxError
from gpucomm.bootstrap.placement import Placement
from gpucomm.bootstrap.world import (World, WorldError, derive_port, detect_world,
                           expand_slurm_nodelist, parse_slurm_tasks_per_node)
from gpucomm.runner.hosts import HostSlots, assign_slots

SECRET_HEX = "00112233445566778899aabbccddeeff" * 2

GPUCOMM_ENV = {
    "GPUCOMM_RANK": "5", "GPUCOMM_SIZE": "8", "GPUCOMM_LOCAL_RANK": "1",
    "GPUCOMM_LOCAL_SIZE": "4", "GPUCOMM_CROSS_RANK": "1", "GPUCOMM_CROSS_SIZE": "2",
    "GPUCOMM_HOSTNAME": "gpu-b", "GPUCOMM_RENDEZVOUS_ADDR": "10.0.0.1",
    "GPUCOMM_RENDEZVOUS_PORT": "29400", "GPUCOMM_SECRET": SECRET_HEX,
    "GPUCOMM_RENDEZVOUS_HOSTED": "1",
}
HOROVOD_ENV = {
    "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_HOSTNAME": "worker-1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234", "HOROVOD_CONTROLLER": "gloo",
}
TORCHRUN_ENV = {
    "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1", "ROLE_RANK": "6", "MASTER_ADDR": "node0.cluster",
    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-42",
    "TORCHELASTIC_RESTART_COUNT": "0",
}
OMPI_ENV = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "0", "OMPI_MCA_ess_base_jobid": "3735814145",
}
PMI_ENV = {
    "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
    "PMI_FD": "7",
}
SLURM_ENV = {
    "SLURM_PROCID": "6", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3", "SLURM_STEP_NUM_NODES": "4", "SLURM_NNODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_NODELIST": "gpu[07-09],login5", "SLURM_JOB_NODELIST": "gpu[07-09],login5",
}
SBATCH_SHELL_ENV = {
    "SLURM_PROCID": "0", "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "0",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[01-02]",
}


def detect(env: dict[str, str]) -> World:
    return detect_world(env, hostname="here")


def layout(w: World) -> tuple:
    return (w.rank, w.size, w.local_rank, w.local_size, w.cross_rank, w.cross_size)


# ------------------------------------------------------------------ launchers

def test_gpucomm_launcher() -> None:
    w = detect(GPUCOMM_ENV)
    assert layout(w) == (5, 8, 1, 4, 1, 2)
    assert w.launcher == "gpucomm" and w.hostname == "gpu-b"
    assert (w.rendezvous_addr, w.rendezvous_port) == ("10.0.0.1", 29400)
    assert w.rendezvous_hosted is True and w.port_via_torch_store is False
    assert w.secret == bytes.fromhex(SECRET_HEX) and w.secret_source == "env"


def test_gpucomm_single_rank_needs_no_secret_or_address() -> None:
    env = {"GPUCOMM_RANK": "0", "GPUCOMM_SIZE": "1", "GPUCOMM_LOCAL_RANK": "0",
           "GPUCOMM_LOCAL_SIZE": "1"}
    w = detect(env)
    assert w.launcher == "gpucomm" and w.secret is None and w.secret_source == "random"
    assert w.rendezvous_addr == "127.0.0.1" and w.hostname == "here"
    assert w.cross_rank is None and w.cross_size is None


def test_world_is_frozen() -> None:
    w = detect(GPUCOMM_ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.rank = 0  # type: ignore[misc]


def test_horovod_launcher() -> None:
    w = detect(HOROVOD_ENV)
    assert layout(w) == (3, 4, 1, 2, 1, 2)
    assert w.launcher == "horovod" and w.hostname == "worker-1"
    assert (w.rendezvous_addr, w.rendezvous_port) == ("10.0.0.9", 41234)
    assert w.secret_source == "derived" and len(w.secret) == 32
    assert w.rendezvous_hosted is False and w.port_via_torch_store is False


def test_horovod_overrides_and_env_secret() -> None:
    env = {**HOROVOD_ENV, "GPUCOMM_RENDEZVOUS_ADDR": "10.1.1.1",
           "GPUCOMM_RENDEZVOUS_PORT": "5000", "GPUCOMM_SECRET": SECRET_HEX}
    w = detect(env)
    assert (w.rendezvous_addr, w.rendezvous_port, w.secret_source) == ("10.1.1.1", 5000, "env")


def test_torchrun_launcher() -> None:
    w = detect(TORCHRUN_ENV)
    assert layout(w) == (6, 8, 2, 4, None, None)  # the cross rank and size come from the arrival records
    assert w.launcher == "torchrun" and w.hostname == "here"
    assert (w.rendezvous_addr, w.rendezvous_port) == ("node0.cluster", 29500)
    assert w.port_via_torch_store is True
    assert w.secret is None and w.secret_source == "torch-store"
    assert w.run_id == "job-42"


def test_torchrun_explicit_port_and_secret() -> None:
    env = {**TORCHRUN_ENV, "GPUCOMM_RENDEZVOUS_PORT": "31000", "GPUCOMM_SECRET": SECRET_HEX}
    w = detect(env)
    assert w.rendezvous_port == 31000 and w.port_via_torch_store is False
    assert w.rendezvous_addr == "node0.cluster" and w.secret_source == "env"


def test_torchrun_cross_size_unknown_when_not_divisible() -> None:
    env = {**TORCHRUN_ENV, "WORLD_SIZE": "7", "RANK": "6"}
    w = detect(env)
    assert w.cross_rank is None and w.cross_size is None


def test_torchrun_needs_local_variables() -> None:
    bare = {k: v for k, v in TORCHRUN_ENV.items() if not k.startswith("LOCAL")}
    with pytest.raises(WorldError, match="LOCAL_RANK"):
        detect(bare)
    with pytest.raises(WorldError, match="LOCAL_WORLD_SIZE"):
        detect({**bare, "LOCAL_RANK": "0"})


def test_openmpi_single_host_uses_loopback_and_derived_port() -> None:
    w = detect(OMPI_ENV)
    assert layout(w) == (2, 4, 2, 4, None, None)
    assert w.launcher == "openmpi" and w.rendezvous_addr == "127.0.0.1"
    assert w.run_id == "3735814145" and w.rendezvous_port == derive_port("3735814145")
    assert w.secret_source == "derived" and len(w.secret) == 32


def test_openmpi_multi_host_with_address() -> None:
    env = {**OMPI_ENV, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "6",
           "GPUCOMM_RENDEZVOUS_ADDR": "head-node", "GPUCOMM_RENDEZVOUS_PORT": "23456"}
    w = detect(env)
    assert (w.rendezvous_addr, w.rendezvous_port) == ("head-node", 23456)


def test_openmpi_multi_host_without_address_fails() -> None:
    env = {**OMPI_ENV, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "6"}
    with pytest.raises(WorldError, match=r"GPUCOMM_RENDEZVOUS_ADDR.*mpirun -x") as info:
        detect(env)
    assert isinstance(info.value, ValueError)


def test_mpich_launcher() -> None:
    w = detect(PMI_ENV)
    assert layout(w) == (1, 2, 1, 2, None, None)
    assert w.launcher == "mpich" and w.rendezvous_addr == "127.0.0.1"
    assert w.run_id == "" and w.rendezvous_port == derive_port("")
    assert w.secret_source == "derived"


def test_torchrun_leaves_the_cross_placement_to_the_arrival_records_on_uneven_nodes() -> None:
    """torchrun with 4 ranks on one node and 2 on the other (--nproc-per-node per node): before, the 2-rank node said
    cross size 3 (6 / 2) while the 4-rank node left it to the records, so the ranks disagreed. Every rank now takes
    Horovod's cross rank from the records: its index among the ranks with its local rank."""
    common = {"WORLD_SIZE": "6", "MASTER_ADDR": "a", "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "2"}
    for rank, local, local_size, node in [(0, 0, 4, 0), (4, 0, 2, 1), (1, 1, 4, 0), (5, 1, 2, 1)]:
        w = detect({**common, "RANK": str(rank), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_size),
                    "GROUP_RANK": str(node)})
        assert (w.cross_rank, w.cross_size) == (None, None)
        records = [{"local_rank": lr} for lr in (0, 1, 2, 3, 0, 1)]
        assert cross_placement(w, records) == {0: (0, 2), 4: (1, 2), 1: (0, 2), 5: (1, 2)}[rank]


def test_srun_with_a_pmi_plugin_is_a_slurm_step() -> None:
    """srun's PMI plugins (--mpi=pmi2, a site's MpiDefault=pmi2; HPE's cray_shasta) set PMI_RANK and PMI_SIZE but not
    Hydra's MPI_LOCALRANKID: before, every task failed with 'MPI_LOCALRANKID is not set'."""
    plain = detect(SLURM_ENV)
    pmi2 = detect({**SLURM_ENV, "PMI_FD": "7", "PMI_JOBID": "123456.0", "PMI_RANK": "6", "PMI_SIZE": "7"})
    shasta = detect({**SLURM_ENV, "PMI_RANK": "6", "PMI_SIZE": "7", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "1"})
    for w in (pmi2, shasta):
        assert w.launcher == "slurm" and layout(w) == layout(plain) and w.run_id == plain.run_id


def test_cray_pals_gives_its_local_variables() -> None:
    """Cray PALS (mpiexec on HPE Cray EX without Slurm) sets PMI_LOCAL_RANK/PMI_LOCAL_SIZE, not Hydra's names."""
    w = detect({"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4",
                "GPUCOMM_RENDEZVOUS_ADDR": "nid001"})
    assert w.launcher == "mpich" and layout(w) == (5, 8, 1, 4, None, None)
    with pytest.raises(WorldError, match="MPI_LOCALRANKID"):  # neither: Hydra's variables were dropped
        detect({"PMI_RANK": "1", "PMI_SIZE": "2"})


def test_slurm_cross_placement_on_uneven_nodes_is_horovods() -> None:
    """-N2 -n3 ("2,1"): local rank 1 runs on one node only, so its cross size is 1 (Horovod's definition, which
    gpucomm-run's placement gives); before, SLURM_STEP_NUM_NODES said 2."""
    base = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "n[1-2]"}
    got = [layout(detect({**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(lr), "SLURM_NODEID": str(n)}))
           for r, lr, n in [(0, 0, 0), (1, 1, 0), (2, 0, 1)]]
    assert got == [(0, 3, 0, 2, 0, 2), (1, 3, 1, 2, 0, 1), (2, 3, 0, 1, 1, 2)]
    assert [(p.cross_rank, p.cross_size) for p in assign_slots([HostSlots("n1", 2), HostSlots("n2", 1)], 3)] == \
        [(0, 2), (0, 1), (1, 2)]


def test_mpich_multi_host_without_address_fails() -> None:
    env = {**PMI_ENV, "PMI_SIZE": "4", "PMI_RANK": "3"}
    with pytest.raises(WorldError, match="GPUCOMM_RENDEZVOUS_ADDR"):
        detect(env)


def test_slurm_step() -> None:
    w = detect(SLURM_ENV)
    assert layout(w) == (6, 7, 0, 1, 3, 4)
    assert w.launcher == "slurm" and w.run_id == "123456.0"
    assert w.rendezvous_addr == "gpu07" and w.rendezvous_port == derive_port("123456.0")
    assert w.secret_source == "derived"


def test_slurm_old_names_only() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_STEPID": "2", "SLURM_JOBID": "77", "SLURM_NTASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "a[1-2]"}
    w = detect(env)
    assert layout(w) == (3, 4, 1, 2, 1, 2)
    assert (w.rendezvous_addr, w.run_id) == ("a1", "77.2")


def test_slurm_arbitrary_distribution_needs_the_address() -> None:
    """srun -m arbitrary places task 0 on the host file's first host, which need not be the node list's
    first (real Slurm: task 0 on node1 of node[0-1]); every rank says so at once instead of guessing."""
    env = {**SLURM_ENV, "SLURM_DISTRIBUTION": "arbitrary"}
    with pytest.raises(WorldError, match=r"SLURM_DISTRIBUTION=arbitrary .*head -n1 \"\$SLURM_HOSTFILE\""):
        detect(env)
    assert detect({**env, "GPUCOMM_RENDEZVOUS_ADDR": "login5"}).rendezvous_addr == "login5"
    one_node = {**env, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu07"}
    assert detect(one_node).rendezvous_addr == "gpu07"  # one host: task 0 can only be there
    assert detect({**SLURM_ENV, "SLURM_DISTRIBUTION": "cyclic"}).rendezvous_addr == "gpu07"


def test_slurm_node_outside_tasks_per_node() -> None:
    with pytest.raises(WorldError, match="SLURM_NODEID=4"):
        detect({**SLURM_ENV, "SLURM_NODEID": "4", "SLURM_STEP_NUM_NODES": "5"})


def test_sbatch_shell_is_not_a_job() -> None:
    w = detect(SBATCH_SHELL_ENV)
    assert w.launcher == "none" and layout(w) == (0, 1, 0, 1, 0, 1)


def test_none_launcher() -> None:
    w = detect({"PATH": "/usr/bin"})
    assert w == World(Placement("here", 0, 1, 0, 1, 0, 1), "none", None, None, False, False, None, "random", "")


# ------------------------------------------------------------------ precedence

@pytest.mark.parametrize("envs, launcher", [
    ((GPUCOMM_ENV, HOROVOD_ENV, TORCHRUN_ENV, OMPI_ENV, PMI_ENV, SLURM_ENV), "gpucomm"),
    ((HOROVOD_ENV, TORCHRUN_ENV, OMPI_ENV, PMI_ENV, SLURM_ENV), "horovod"),
    ((TORCHRUN_ENV, OMPI_ENV, PMI_ENV, SLURM_ENV), "torchrun"),
    ((OMPI_ENV, PMI_ENV, SLURM_ENV), "openmpi"),
    ((PMI_ENV, SLURM_ENV), "mpich"),
])
def test_precedence(envs: tuple[dict[str, str], ...], launcher: str) -> None:
    merged: dict[str, str] = {}
    for env in reversed(envs):
        merged.update(env)
    assert detect(merged).launcher == launcher


def test_torchrun_marker_needs_both_rank_and_world_size() -> None:
    assert detect({"RANK": "0"}).launcher == "none"


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("env, pattern", [
    ({**GPUCOMM_ENV, "GPUCOMM_RANK": "8"}, r"GPUCOMM_RANK=8 is not below GPUCOMM_SIZE=8"),
    ({**GPUCOMM_ENV, "GPUCOMM_RANK": "-1"}, r"GPUCOMM_RANK=-1"),
    ({**GPUCOMM_ENV, "GPUCOMM_SIZE": "0", "GPUCOMM_RANK": "0"}, r"GPUCOMM_SIZE=0 is below 1"),
    ({**GPUCOMM_ENV, "GPUCOMM_LOCAL_RANK": "4"}, r"GPUCOMM_LOCAL_RANK=4 is not below"),
    ({**GPUCOMM_ENV, "GPUCOMM_LOCAL_SIZE": "9"}, r"GPUCOMM_LOCAL_SIZE=9"),
    ({**GPUCOMM_ENV, "GPUCOMM_CROSS_RANK": "2"}, r"GPUCOMM_CROSS_RANK=2 is not below"),
    ({**GPUCOMM_ENV, "GPUCOMM_SIZE": "eight"}, r"GPUCOMM_SIZE='eight' is not an integer"),
    ({**GPUCOMM_ENV, "GPUCOMM_LOCAL_SIZE": ""}, r"GPUCOMM_LOCAL_SIZE is not set"),
    ({**GPUCOMM_ENV, "GPUCOMM_RENDEZVOUS_PORT": "70000"}, r"GPUCOMM_RENDEZVOUS_PORT=70000"),
    ({**GPUCOMM_ENV, "GPUCOMM_RENDEZVOUS_PORT": "0"}, r"1\.\.65535"),
    ({**GPUCOMM_ENV, "GPUCOMM_SECRET": "zz" * 16}, r"GPUCOMM_SECRET is not a hex string"),
    ({**GPUCOMM_ENV, "GPUCOMM_SECRET": "abcd"}, r"GPUCOMM_SECRET decodes to 2 bytes"),
    ({k: v for k, v in GPUCOMM_ENV.items() if k != "GPUCOMM_SECRET"}, r"GPUCOMM_SECRET is not set"),
    ({k: v for k, v in GPUCOMM_ENV.items() if k != "GPUCOMM_RENDEZVOUS_ADDR"},
     r"GPUCOMM_RENDEZVOUS_ADDR"),
    ({**GPUCOMM_ENV, "GPUCOMM_RENDEZVOUS_HOSTED": "maybe"}, r"GPUCOMM_RENDEZVOUS_HOSTED"),
    ({**HOROVOD_ENV, "HOROVOD_LOCAL_RANK": "x"}, r"HOROVOD_LOCAL_RANK='x'"),
    ({**HOROVOD_ENV, "HOROVOD_GLOO_RENDEZVOUS_PORT": "99999"}, r"HOROVOD_GLOO_RENDEZVOUS_PORT"),
    ({**TORCHRUN_ENV, "RANK": "8"}, r"RANK=8 is not below WORLD_SIZE=8"),
    ({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}, r"MASTER_ADDR"),
    ({**TORCHRUN_ENV, "MASTER_PORT": "http"}, r"MASTER_PORT='http'"),
    ({**OMPI_ENV, "OMPI_COMM_WORLD_LOCAL_SIZE": "5"}, r"OMPI_COMM_WORLD_LOCAL_SIZE=5"),
    ({**PMI_ENV, "MPI_LOCALRANKID": "2"}, r"MPI_LOCALRANKID=2 is not below MPI_LOCALNRANKS=2"),
    ({**SLURM_ENV, "SLURM_PROCID": "7"}, r"SLURM_PROCID=7 is not below SLURM_STEP_NUM_TASKS=7"),
    ({**SLURM_ENV, "SLURM_STEP_TASKS_PER_NODE": "2(x3"}, r"bad entry"),
    ({**SLURM_ENV, "SLURM_STEP_NODELIST": "gpu[07-09"}, r"unclosed"),
])
def test_inconsistent_env_raises(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(WorldError, match=pattern) as info:
        detect(env)
    assert isinstance(info.value, ValueError)


def test_error_message_states_cause_and_fix() -> None:
    with pytest.raises(WorldError) as info:
        detect({**GPUCOMM_ENV, "GPUCOMM_RANK": "4", "GPUCOMM_SIZE": "4"})
    text = str(info.value)
    assert "0 <= rank < size" in text and "disagree" in text and "unset" in text


def test_secret_value_is_not_echoed() -> None:
    bad = "ab" * 7 + "zz"
    with pytest.raises(WorldError) as info:
        detect({**GPUCOMM_ENV, "GPUCOMM_SECRET": bad})
    assert bad not in str(info.value)


# ------------------------------------------------------------------ parsing helpers

@pytest.mark.parametrize("text, hosts", [
    ("login5", ["login5"]),
    ("node[01-03,07],gpu-a[1-2],login5",
     ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2", "login5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b[1],c", ["a", "b1", "c"]),
    ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
    (" x[0-1] ", ["x0", "x1"]),
])
def test_expand_slurm_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n]1[", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_expand_slurm_nodelist_rejects_garbage(text: str) -> None:
    with pytest.raises(SlurmSyntaxError):
        expand_slurm_nodelist(text)
    with pytest.raises(WorldError, match="SLURM_STEP_NODELIST: Slurm hostlist"):  # detect_world names the variable
        detect({**SLURM_ENV, "SLURM_STEP_NODELIST": text})


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,3(x2),2", [1, 3, 3, 2]),
    ("8(x1)", [8]),
])
def test_parse_slurm_tasks_per_node(text: str, counts: list[int]) -> None:
    assert parse_slurm_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "2(3)", "-1"])
def test_parse_slurm_tasks_per_node_rejects_garbage(text: str) -> None:
    with pytest.raises(SlurmSyntaxError):
        parse_slurm_tasks_per_node(text)


def test_derive_port_is_stable_and_in_range() -> None:
    ports = {derive_port(f"job-{i}") for i in range(2000)}
    assert all(20000 <= p < 32768 for p in ports)  # below Linux's default ephemeral ports
    assert len(ports) > 1500  # spreads jobs over the range
    assert derive_port("123456.0") == derive_port("123456.0")
    assert 20000 <= derive_port("") < 32768


def test_derived_secret_is_shared_by_all_ranks() -> None:
    a = detect(SLURM_ENV)
    b = detect({**SLURM_ENV, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"})
    c = detect({**SLURM_ENV, "SLURM_JOB_ID": "999"})
    assert a.secret == b.secret and a.secret != c.secret


# ------------------------------------------------------------------ os.environ

def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith(("GPUCOMM_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "MPI_")) \
                or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    for name, value in PMI_ENV.items():
        monkeypatch.setenv(name, value)
    w = detect_world(hostname="me")
    assert w.launcher == "mpich" and w.rank == 1 and w.hostname == "me"


def test_hostname_falls_back_to_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W.socket, "gethostname", lambda: "kernel-host")
    assert detect_world({}).hostname == "kernel-host"
    assert detect_world({}, hostname="given").hostname == "given"


def test_slurm_multi_node_without_nodelist_fails() -> None:
    env = {k: v for k, v in SLURM_ENV.items() if not k.endswith("NODELIST")}
    with pytest.raises(WorldError, match="SLURM_STEP_NODELIST"):
        detect(env)
    w = detect({**env, "GPUCOMM_RENDEZVOUS_ADDR": "gpu07"})
    assert w.rendezvous_addr == "gpu07"


def test_overrides_for_torchrun_address_run_id_and_hosted_flag() -> None:
    env = {**TORCHRUN_ENV, "GPUCOMM_RENDEZVOUS_ADDR": "10.2.2.2", "GPUCOMM_RUN_ID": "mine",
           "GPUCOMM_RENDEZVOUS_HOSTED": "1"}
    w = detect(env)
    assert (w.rendezvous_addr, w.rendezvous_port, w.port_via_torch_store) == \
        ("10.2.2.2", 29500, True)
    assert w.run_id == "mine" and w.rendezvous_hosted is True
