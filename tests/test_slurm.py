"""gpucomm under real Slurm (Debian's slurm-wlm, started by ``tests/slurm_cluster.py``): the
``launch/slurm.sbatch`` recipe trains a 2-rank job to completion, a plain ``srun`` is detected as a Slurm
step (ranks, layout and the store's address from the node list), and a task that dies ends the job with
its cause instead of hanging it. Where namespace hosts can be made (``tests/cluster.py``), two nodes: the
store found on the node list's first host from the other, and ``srun -m arbitrary`` (task 0 elsewhere)
refused at once on every rank. Root only, and only when asked for (``-m slurm``); ``.ci/slurm_step.sh``
installs Slurm and runs this file."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from gpucomm.bootstrap.world import derive_port, expand_slurm_nodelist
from tests import cluster as netns
from tests.harness import ROOT
from tests.slurm_cluster import SlurmCluster, require_slurm, slurm_cluster

pytestmark = pytest.mark.slurm

RECIPE = ROOT / "launch" / "slurm.sbatch"
# launch/slurm.sbatch asks for 2 nodes x 4 tasks with 4 GPUs and 8 CPUs each; sbatch's command line
# overrides its #SBATCH lines, and --gpus-per-node=0 drops the GPU request on a cluster without any
RECIPE_ON_ONE_CPU_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
                          "--time=00:10:00"]
JOB_TIMEOUT = 180.0  # seconds a 2-rank job may take on a busy 2-core runner (importing torch is most of it)

TRAIN = textwrap.dedent("""\
    import hashlib, json, os, socket
    import torch
    import gpucomm.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # each rank starts from other weights: the broadcast must make them one
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())  # and trains on a shard of its own, whose targets
    x = torch.randn(64, 4, generator=data)                  # disagree with the other's by 1 in the bias: only
    y = x @ torch.tensor([[1.0, -2.0, 3.0, 0.5]]).T + 0.25 + hvd.rank()  # averaged gradients make one model
    losses = []
    for step in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    mean = hvd.allreduce(torch.tensor([losses[-1]]), op=hvd.Average, name="final_loss").item()
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print("TRAINED " + json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "host": socket.gethostname(), "job": os.environ["SLURM_JOB_ID"], "first_loss": losses[0],
        "last_loss": losses[-1], "mean_final_loss": mean, "weights": hashlib.sha256(weights).hexdigest()}),
        flush=True)
    hvd.shutdown()
""")

PROBE = textwrap.dedent("""\
    import json, os, socket
    import torch
    import gpucomm.torch as hvd
    from gpucomm.bootstrap.world import detect_world

    hvd.init()
    world = detect_world()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="probe").item()
    print("PROBE " + json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "launcher": world.launcher,
        "addr": world.rendezvous_addr, "port": world.rendezvous_port, "host": socket.gethostname(),
        "nodelist": os.environ["SLURM_STEP_NODELIST"], "job": os.environ["SLURM_JOB_ID"],
        "step": os.environ["SLURM_STEP_ID"], "total": total}), flush=True)
    hvd.shutdown()
""")

DIE = textwrap.dedent("""\
    import os, signal, sys, time
    import torch
    import gpucomm.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm-up")
    if hvd.rank() == 1:
        print(f"DYING rank 1 ({sys.argv[1]}) at {time.time():.6f}", flush=True)
        if sys.argv[1] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    for step in range(1_000_000):  # rank 0 goes on until the job is ended around it
        hvd.allreduce(torch.ones(1), name=f"step{step}")
        time.sleep(0.01)
""")


@pytest.fixture(scope="module")
def slurm(request) -> SlurmCluster:
    """One single-node cluster for this module's tests; its tear-down must leave no process behind."""
    require_slurm(request.config)
    with slurm_cluster() as cluster:
        yield cluster
    assert cluster.leftovers == [], cluster.leftovers
    assert not cluster.tmp.exists()


def _records(text: str, tag: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith(tag + " ")]


def _submit(slurm: SlurmCluster, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """``sbatch`` the recipe with ``args`` (overrides, then the command), wait for the job to end; returns
    (JobEnd, the job's output file's text, the tasks still alive after the job)."""
    output = tmp_path / "job-%j.out"
    with slurm.started(["sbatch", "--parsable", f"--output={output}", *args], env=env) as sbatch:
        out, err = sbatch.proc.communicate(timeout=60)
        assert sbatch.proc.returncode == 0, f"sbatch refused the job:\n{out}{err}"
        job_id = out.strip().split(";")[0]
        end = slurm.wait_job(job_id, JOB_TIMEOUT)
    text = Path(str(output).replace("%j", job_id)).read_text()
    return end, text, sbatch.leftovers


def test_the_sbatch_recipe_trains_a_2_rank_job(slurm, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    end, text, leftovers = _submit(slurm, tmp_path, *RECIPE_ON_ONE_CPU_NODE, str(RECIPE), "python", str(script))
    assert (end.state, end.exit_code) == ("COMPLETED", 0), f"{end.record}\n{text}"
    ranks = sorted(_records(text, "TRAINED"), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"]) for r in ranks] == [(0, 2, 0, 2), (1, 2, 1, 2)], \
        text
    assert {r["job"] for r in ranks} == {end.job_id}
    # the gradients were averaged: both ranks end with the same weights although each trained on its own shard,
    # at the optimum of the two shards together (bias 0.75: a squared error of 0.5 ** 2 on either shard)
    assert ranks[0]["weights"] == ranks[1]["weights"], text
    assert ranks[0]["mean_final_loss"] == ranks[1]["mean_final_loss"]
    assert abs(ranks[0]["mean_final_loss"] - 0.25) < 0.02, text
    assert all(r["last_loss"] < r["first_loss"] / 10 for r in ranks), text
    # the recipe's secret reached both ranks: no rank fell back to a derived key (it would warn)
    assert "WARNING" not in text and "Traceback" not in text, text
    assert leftovers == []


def test_srun_is_detected_as_a_slurm_step(slurm, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = slurm.run(["srun", "--ntasks=2", "--kill-on-bad-exit=1", "python", str(script)], timeout=JOB_TIMEOUT,
                  env={"GPUCOMM_LOG_LEVEL": "INFO"})
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = sorted(_records(r.stdout, "PROBE"), key=lambda p: p["rank"])
    layout = [(p["rank"], p["size"], p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"]) for p in ranks]
    assert layout == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)], r.stdout
    assert all(p["launcher"] == "slurm" and p["total"] == 3.0 for p in ranks), r.stdout
    first = expand_slurm_nodelist(ranks[0]["nodelist"])[0]
    assert first == slurm.nodes[0].name
    port = derive_port(f"{ranks[0]['job']}.{ranks[0]['step']}")
    assert all((p["addr"], p["port"]) == (first, port) for p in ranks), r.stdout
    # what init() itself used: the node list's first host (not the loopback a job without one falls back to)
    for rank in (0, 1):
        assert re.search(rf"gpucomm rank {rank} INFO .*rendezvous store at {re.escape(first)}:{port} reached "
                         rf"\(launcher: slurm\)", r.stderr), r.stderr
    assert r.leftovers == []


@pytest.mark.parametrize("plugin", ["pmi2"])  # (cray_shasta sets its PMI_* only under HPE's PALS, absent here)
def test_srun_with_an_mpi_plugin_is_still_a_slurm_step(slurm, tmp_path, plugin):
    """srun's PMI plugins (--mpi=pmi2, a site's MpiDefault=pmi2; HPE's cray_shasta) export PMI_RANK and PMI_SIZE
    besides Slurm's variables: before, gpucomm took the task for one of MPICH's mpiexec and every task failed with
    'MPI_LOCALRANKID is not set' (found by helper-61)."""
    plugins = slurm.run(["srun", "--mpi=list"], timeout=60)
    if plugin not in plugins.stdout + plugins.stderr:
        pytest.skip(f"this Slurm build has no mpi/{plugin} plugin (srun --mpi=list: {plugins.stdout + plugins.stderr})")
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace('"step": os.environ["SLURM_STEP_ID"],',
                                    '"step": os.environ["SLURM_STEP_ID"], "pmi": os.environ.get("PMI_RANK"),'))
    r = slurm.run(["srun", f"--mpi={plugin}", "--ntasks=2", "--kill-on-bad-exit=1", "python", str(script)],
                  timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = sorted(_records(r.stdout, "PROBE"), key=lambda p: p["rank"])
    assert [p["pmi"] for p in ranks] == ["0", "1"], r.stdout  # the plugin's variables were there
    assert [(p["rank"], p["size"], p["local_rank"], p["local_size"]) for p in ranks] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert all(p["launcher"] == "slurm" and p["total"] == 3.0 for p in ranks), r.stdout
    assert r.leftovers == []


@pytest.mark.parametrize("how, cause", [("sigkill", "task 1: Killed"), ("exit", "task 1: Exited with exit code 3")],
                         ids=["sigkill", "exit-3"])
def test_a_task_that_dies_ends_the_job_with_its_cause(slurm, tmp_path, how, cause):
    script = tmp_path / "die.py"
    script.write_text(DIE)
    end, text, leftovers = _submit(slurm, tmp_path, *RECIPE_ON_ONE_CPU_NODE, str(RECIPE), "python", str(script), how)
    assert end.state == "FAILED" and end.exit_code != 0, f"{end.record}\n{text}"
    assert re.search(rf"srun: error: {re.escape(slurm.nodes[0].name)}: {cause}$", text, re.M), text
    died = float(re.search(r"DYING rank 1 \(\w+\) at ([0-9.]+)", text).group(1))
    stopped = next(t for t, state in end.states if state not in ("PENDING", "RUNNING"))
    print(f"\n[slurm] rank 1 {how}: job {end.job_id} {end.state} (ExitCode {end.exit_code}:{end.signal}); its step "
          f"ended {stopped - died:.2f} s and the job {end.first_seen(end.state) - died:.2f} s after the task died "
          f"(states seen: {[s for _, s in end.states]}, polled every {slurm.POLL:g} s)")
    assert leftovers == []


@pytest.fixture(scope="module")
def two_nodes(request) -> SlurmCluster:
    """A two-node cluster: each node a namespace host of tests/cluster.py, with its own address and name."""
    require_slurm(request.config)
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"cannot make namespace hosts here: {reason}")
    with netns.cluster(2) as hosts, slurm_cluster(hosts=hosts.hosts) as cluster:
        yield cluster
    assert cluster.leftovers == [], cluster.leftovers


def _probe_layout(stdout: str) -> list[tuple]:
    ranks = sorted(_records(stdout, "PROBE"), key=lambda p: p["rank"])
    return [(p["rank"], p["local_rank"], p["local_size"], p["host"], p["addr"], p["nodelist"], p["total"])
            for p in ranks]


def test_srun_across_two_nodes_finds_the_store_on_the_first(two_nodes, tmp_path):
    """Rank 1 runs on node1 and finds the store on node0, the first host of the step's node list."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = two_nodes.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "python", str(script)],
                      timeout=JOB_TIMEOUT, env={"GPUCOMM_LOG_LEVEL": "INFO"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert _probe_layout(r.stdout) == [(0, 0, 1, "node0", "node0", "node[0-1]", 3.0),
                                       (1, 0, 1, "node1", "node0", "node[0-1]", 3.0)], r.stdout
    assert all(p["size"] == 2 and p["cross_size"] == 2 for p in _records(r.stdout, "PROBE"))
    assert re.search(r"gpucomm rank 1 INFO .*rendezvous store at node0:\d+ reached \(launcher: slurm\)", r.stderr), \
        r.stderr
    assert r.leftovers == []


def test_srun_with_tasks_placed_by_a_host_file(two_nodes, tmp_path):
    """``srun -m arbitrary`` puts task 0 on node1 although the node list starts with node0: every rank
    fails at once saying which variable to set (before the fix, rank 0 failed to serve the store on node0's
    address and rank 1 waited for it until the start timeout); with it set, the job runs."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1\nnode0\n")
    cmd = ["srun", "--nodes=2", "--ntasks=2", "--distribution=arbitrary", "python", str(script)]
    env = {"SLURM_HOSTFILE": str(hostfile), "GPUCOMM_START_TIMEOUT": "60"}
    r = two_nodes.run(cmd, timeout=JOB_TIMEOUT, env=env)
    assert r.returncode != 0, r.stdout + r.stderr
    assert r.stderr.count("WorldError: No rendezvous address") == 2, r.stderr
    # both ranks stopped with the cause (a rank that waited for a store that never came would fail with the
    # start timeout's error instead)
    assert "SLURM_DISTRIBUTION=arbitrary" in r.stderr, r.stderr
    assert "could not reach the gpucomm rendezvous store" not in r.stderr, r.stderr
    r = two_nodes.run(cmd, timeout=JOB_TIMEOUT, env={**env, "GPUCOMM_RENDEZVOUS_ADDR": "node1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert _probe_layout(r.stdout) == [(0, 0, 1, "node1", "node1", "node[0-1]", 3.0),
                                       (1, 0, 1, "node0", "node1", "node[0-1]", 3.0)], r.stdout
    assert r.leftovers == []
