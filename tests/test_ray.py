"""gpucomm on Ray (issue 38): Horovod's ``RayExecutor`` and ``ElasticRayExecutor``, and the Ray Train
backend, on a real local Ray cluster (``ray.init(num_cpus=2)``, one per module; no mocks).

These tests carry the ``ray`` marker and run in their own step (``pytest -m ray``, or with
``GPUCOMM_TEST_RAY=1``; ``.ci/ray_step.sh`` installs the ``ray`` extra and runs them): starting Ray
takes seconds and its processes a core. Elsewhere, or without Ray installed, they skip saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import PYTHON, run
from tests.steps import selected

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "ray_elastic_train.py")


def ray_selected(config) -> bool:
    """Whether this run asked for the Ray tests (``-m ray``, or ``GPUCOMM_TEST_RAY=1``)."""
    return selected(config, "ray")


def ray_processes() -> set[int]:
    """Processes of this test's Ray cluster: this process's descendants (raylet, GCS, workers...)."""
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def cluster(request):
    """A local Ray cluster of 2 CPUs for the module; afterwards no process (nor file) of it is left."""
    if not ray_selected(request.config):
        pytest.skip("the Ray tests run in their own step: `python -m pytest -m ray tests/test_ray.py` "
                    "(or GPUCOMM_TEST_RAY=1), with the ray extra installed (.ci/ray_step.sh)")
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
    pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install -e '.[ray]'")
    temp = tempfile.mkdtemp(prefix="gpucomm-ray-")  # Ray's sessions and logs, removed afterwards
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, _temp_dir=temp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "GPUCOMM_TIMEOUT": "60"}})
    try:
        yield ray
    finally:
        started = ray_processes()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        deadline = time.monotonic() + 30
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(started)
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not left, f"processes of the Ray cluster outlived ray.shutdown(): {left}"


# ---------------------------------------------------------------------------------------------
# functions the workers run (this module is importable in the workers: Ray's workers share the
# driver's working directory and sys.path on a local cluster)


def train(steps: int, log_every: int = 0) -> dict:
    """A small regression model with hvd.DistributedOptimizer; each rank draws its own batches."""
    import torch

    import gpucomm.torch as hvd
    from gpucomm.ray import ray_logger

    hvd.init()
    torch.manual_seed(1000 + hvd.rank())  # different initial weights: the broadcast must make them agree
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 31 + hvd.rank())
        x = torch.randn(16, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if log_every and hvd.rank() == 0 and step % log_every == 0:
            ray_logger.log({"step": step, "loss": loss.item()})
    final = hvd.allreduce(loss.detach(), op=hvd.Average, name="final_loss").item()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "loss": final, "params": [p.detach().clone() for p in model.parameters()],
            "host": os.environ["GPUCOMM_HOSTNAME"], "pid": os.getpid()}


def die_at(step_to_die: int, steps: int) -> int:
    """Rank 1 kills its own process (SIGKILL) in the middle of training."""
    import torch

    import gpucomm.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    for step in range(steps):
        if step == step_to_die and hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    return hvd.rank()


def joins_and_sums() -> float:
    """Joins the elastic run's round (hvd.init) and sums a one over the ranks."""
    import torch

    import gpucomm.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="joined").item()
    hvd.shutdown()
    return total


class Counter:
    """An ``executable_cls``: one instance per worker."""

    def __init__(self, start: int, step: int = 1) -> None:
        self.value, self.step = start, step

    def bump(self) -> int:
        self.value += self.step
        return self.value


def store_of_worker(_executable) -> tuple[str, int, str]:
    env = os.environ
    return env["GPUCOMM_RENDEZVOUS_ADDR"], int(env["GPUCOMM_RENDEZVOUS_PORT"]), env["GPUCOMM_SECRET"]


def raises_on_rank_0() -> None:
    import gpucomm.torch as hvd

    hvd.shutdown()  # a job an earlier call left failed: start a new one
    hvd.init()
    if hvd.rank() == 0:
        raise ValueError("bad batch on rank 0")
    hvd.allreduce(__import__("torch").ones(1), name="never_completes_without_rank_0")


# ---------------------------------------------------------------------------------------------
# RayExecutor


def test_executor_trains_and_every_call_kind_works(cluster):
    from gpucomm.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1)
    executor.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5},
                   extra_env_vars={"MY_SETTING": "on"})
    try:
        logged = []
        results = executor.run(train, args=(30,), kwargs={"log_every": 10}, callbacks=[logged.append])
        assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}
        node_ip = cluster.util.get_node_ip_address()
        assert [(r["local_rank"], r["local_size"], r["host"]) for r in results] == [(0, 2, node_ip), (1, 2, node_ip)]
        for a, b in zip(results[0]["params"], results[1]["params"]):
            assert bool((a == b).all()), "the ranks ended with different parameters"
        assert results[0]["loss"] == results[1]["loss"] < 5.0
        assert [v["step"] for v in logged] == [0, 10, 20] and all(v["loss"] > 0 for v in logged)

        assert executor.execute(lambda counter: counter.bump()) == [15, 15]
        assert executor.execute_single(lambda counter: counter.bump()) == 20  # rank 0's instance only
        assert executor.execute(lambda counter: counter.value) == [20, 15]
        refs = executor.run_remote(lambda a, b: os.environ["MY_SETTING"] + str(a * b), args=(3,), kwargs={"b": 4})
        assert cluster.get(refs) == ["on12", "on12"]
        addr, port, secret = executor.execute_single(store_of_worker)
        for p in psutil.process_iter(["cmdline"]):
            assert secret not in " ".join(p.info["cmdline"] or ()), f"the job secret is on {p.pid}'s command line"
    finally:
        executor.shutdown()
    pids = [r["pid"] for r in results]
    assert alive(pids) == [] and executor.leftover_pids == []
    with pytest.raises(ConnectionRefusedError):  # the store is closed
        socket.create_connection((addr, port), timeout=5).close()
    with pytest.raises(RuntimeError, match=r"call start\(\) first"):
        executor.run(train, args=(1,))


def test_a_worker_killed_mid_training_fails_run_promptly_naming_its_rank(cluster):
    from gpucomm.errors import RunError
    from gpucomm.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        pids = executor.execute(lambda _: os.getpid())
        with pytest.raises(RunError) as caught:  # a dead worker, named: not the 60 s collective timeout's error
            executor.run(die_at, args=(5, 10_000))
        message = str(caught.value)
        assert caught.value.rank == 1, message
        assert f"rank 1 of 2 (node {cluster.util.get_node_ip_address()}, pid {pids[1]}) died" in message
        with pytest.raises(RunError, match=r"lost a worker \(rank 1 died in an earlier call\).*shutdown\(\)"):
            executor.run(die_at, args=(5, 10))
    finally:
        executor.shutdown()
    assert alive(pids) == []


def test_an_exception_on_one_rank_names_it_with_its_traceback(cluster):
    from gpucomm.errors import RunError
    from gpucomm.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        with pytest.raises(RunError) as caught:
            executor.run(raises_on_rank_0)
        err = caught.value
        assert err.rank == 0 and isinstance(err.exception, ValueError), str(err)
        assert "rank 0 of 2" in str(err) and "raised ValueError: bad batch on rank 0" in str(err)
        assert "raises_on_rank_0" in err.remote_traceback
        # rank 0's worker reports its exception to the job, as a script's uncaught exception is: rank 1's
        # collective fails naming it (instead of waiting for rank 0 until GPUCOMM_TIMEOUT, 60 s here)
        refs = executor.run_remote(raises_on_rank_0)
        with pytest.raises(cluster.exceptions.RayTaskError, match="rank 0 failed: ValueError: bad batch on rank 0"):
            cluster.get(refs[1], timeout=30)
        with pytest.raises(ValueError, match="bad batch on rank 0"):
            cluster.get(refs[0], timeout=30)
    finally:
        executor.shutdown()


def test_misuse_is_refused_with_what_to_do(cluster):
    from gpucomm.ray import RayExecutor

    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="give num_workers"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="use_gpu must be True"):
        RayExecutor(settings, num_workers=1, gpus_per_worker=1)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="GPUCOMM_TIMEOUT"):
        RayExecutor(settings, num_workers=1).start(extra_env_vars={"GPUCOMM_TIMEOUT": "soon"})
    with pytest.warns(UserWarning, match="ssh_str accepted, no effect"):
        RayExecutor.create_settings(ssh_str="-----BEGIN KEY-----")
    with pytest.raises(ValueError, match="'nosuchnic0' .* has no IPv4 or global IPv6 address"):
        RayExecutor(RayExecutor.create_settings(nics={"nosuchnic0"}), num_workers=1).start()
    # two hosts on a one-node cluster: Ray cannot spread the bundles, said within the timeout
    spread = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_hosts=2,
                         num_workers_per_host=1)
    with pytest.raises(TimeoutError, match="STRICT_SPREAD: one per host"):
        spread.start()
    deadline = time.monotonic() + 15  # nothing held afterwards (Ray frees resources asynchronously)
    while cluster.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.available_resources().get("CPU") == 2.0


def test_ranks_follow_the_nodes_where_ray_placed_the_workers():
    """Pure: the order by node IP (numerically), local ranks per node, and CUDA_VISIBLE_DEVICES
    with each worker's own GPU at the index of its local rank."""
    from gpucomm.ray.layout import ActorInfo, check_distinct_gpus, placements, rank_order, visible_devices

    infos = [ActorInfo("b", "10.0.0.10", "h10", 11, ("3",)), ActorInfo("a", "10.0.0.9", "h9", 12, ("1",)),
             ActorInfo("b", "10.0.0.10", "h10", 13, ("0",)), ActorInfo("a", "10.0.0.9", "h9", 14, ("5", "6"))]
    order = rank_order(infos)
    assert order == [1, 3, 0, 2]  # 10.0.0.9 before 10.0.0.10, then creation order
    ranked = [infos[i] for i in order]
    slots = placements(ranked)
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.host) for s in slots] == [
        (0, 0, 2, 0, 2, "10.0.0.9"), (1, 1, 2, 0, 2, "10.0.0.9"), (2, 0, 2, 1, 2, "10.0.0.10"),
        (3, 1, 2, 1, 2, "10.0.0.10")]
    assert visible_devices(ranked) == ["1,5,6", "1,5,6", "3,0", "3,0"]
    check_distinct_gpus(ranked)
    with pytest.raises(RuntimeError, match="both given GPU 1"):
        check_distinct_gpus([infos[1], ActorInfo("a", "10.0.0.9", "h9", 15, ("1",))])


def test_each_worker_sees_the_gpus_that_make_gpucomm_pin_its_own():
    """Pure: what each worker's CUDA_VISIBLE_DEVICES is set to. Two GPUs per worker: the worker's own
    first GPU at the index of its local rank (Ray Train's shared listing "0,1,2,3" would give local
    rank 1 its neighbour's GPU 1); ids past 9 in numeric order of the workers, not as text; an elastic
    worker sees its own GPU alone (its local rank changes between rounds); no GPU: nothing visible."""
    from gpucomm.ray.layout import ActorInfo, cuda_visible_devices

    two_each = [ActorInfo("a", "10.0.0.9", "h", 1, ("0", "1")), ActorInfo("a", "10.0.0.9", "h", 2, ("2", "3"))]
    listed = cuda_visible_devices(two_each, True)
    assert listed == ["0,2,1,3", "0,2,1,3"]
    assert [v.split(",")[rank] for rank, v in enumerate(listed)] == ["0", "2"]  # what local rank r pins
    eleven = [ActorInfo("a", "10.0.0.9", "h", i, (str(i),)) for i in (2, 10)]
    assert [v.split(",")[r] for r, v in enumerate(cuda_visible_devices(eleven, True))] == ["2", "10"]
    assert cuda_visible_devices(two_each, True, own_only=True) == ["0", "2"]
    assert cuda_visible_devices(two_each, False) == ["", ""]


# ---------------------------------------------------------------------------------------------
# elastic


def test_elastic_example_recovers_from_a_worker_killed_mid_training(cluster):
    """examples/ray_elastic_train.py as a script (Horovod's elastic API shape), joining this
    module's cluster: rank 1 kills itself once; the job re-forms with the survivor and finishes."""
    address = cluster.get_runtime_context().gcs_address
    r = run([PYTHON, EXAMPLE, "--address", address, "--fail-at-batch", "5", "--epochs", "3"], timeout=150)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "round 1: 2 worker(s)" in out and re.search(r"worker 1 \(\S+\) died", out), out[-4000:]
    assert "round 2: 1 worker(s)" in out, out[-4000:]
    results = re.findall(r"worker result: (\{.*\})", r.stdout)
    assert len(results) == 1, r.stdout
    result = eval(results[0])  # noqa: S307 - the example prints a dict of numbers and lists
    assert result["size"] == 1 and result["epochs"] == 3 and result["sizes"] == [1, 2]
    assert result["accuracy"] > 0.5, result
    worker_pids = [int(p) for p in re.findall(r"started worker \d+ on \S+ \(\S+, pid (\d+)\)", out)]
    assert len(worker_pids) == 2 and alive(worker_pids) == []
    assert r.leftovers == []


def test_elastic_job_with_no_survivor_fails_with_the_workers_error(cluster):
    from gpucomm.errors import ElasticJobError
    from gpucomm.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2, elastic_timeout=20, timeout_s=60)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    with pytest.raises(RuntimeError, match=r"call start\(\) before run\(\)"):
        executor.run(lambda: 1)
    executor.start()
    with pytest.raises(ElasticJobError) as caught:  # the workers' own error, not elastic_timeout's
        executor.run(lambda: 1 / 0)
    assert "no worker is left" in str(caught.value) and "ZeroDivisionError" in str(caught.value)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert executor.leftover_pids == []


class _OneNodeAndOneThatIsNot:
    """Discovery listing this node (1 slot) and a host that is no Ray node's: its actor can never be placed."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        import ray

        return {ray.util.get_node_ip_address(): 1, "10.255.255.1": 1}


def test_a_slot_that_cannot_start_leaves_out_only_itself(cluster, capsys):
    """Round 1 chooses two slots; one's actor cannot be placed and its slot is left out after timeout_s. The actor
    that did start is stopped and started again as a fresh member, and the job runs with it. Before, it was neither
    a member nor fresh: the driver waited elastic_timeout for 'only 0 slot(s)' while it held its CPU."""
    from gpucomm.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, elastic_timeout=30, timeout_s=12,
                                                  verbose=True)
    settings.discovery = _OneNodeAndOneThatIsNot()
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    assert executor.run(lambda: os.environ["GPUCOMM_ELASTIC"]) == ["1"]
    assert executor.leftover_pids == []
    said = "".join(capsys.readouterr())
    assert "(10.255.255.1:0) was not up within timeout_s=12 s" in said and "leaving the slot out" in said, said
    assert "round 1: 1 worker(s)" in said, said


def test_ray_executor_with_min_workers_runs_elastically(cluster):
    from gpucomm.errors import ElasticJobError
    from gpucomm.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=2)
    executor.start(extra_env_vars={"MY_SETTING": "elastic"})
    try:
        assert executor.run(lambda a: (os.environ["MY_SETTING"], os.environ["GPUCOMM_ELASTIC"], a + 1),
                            args=(1,)) == [("elastic", "1", 2)] * 2
        # each run is a job of its own: its rounds start again at 1, in a store of its own (before, they met the
        # earlier runs' rounds under the same keys, and a failed run's verdict ended every later one)
        assert executor.run(joins_and_sums) == [2.0, 2.0]
        with pytest.raises(ElasticJobError, match="ZeroDivisionError"):
            executor.run(lambda: 1 / 0)
        assert executor.run(joins_and_sums) == [2.0, 2.0]
        with pytest.raises(NotImplementedError, match="workers are ephemeral"):
            executor.run_remote(lambda: 1)
        with pytest.raises(NotImplementedError, match="use execute"):
            executor.execute_single(lambda _: 1)
    finally:
        executor.shutdown()
    assert executor.leftover_pids == []


# ---------------------------------------------------------------------------------------------
# Ray Train


def train_loop_per_worker(config: dict) -> None:
    import torch
    import ray.train

    import gpucomm.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    for step in range(config["steps"]):
        g = torch.Generator().manual_seed(step * 7 + hvd.rank())
        x = torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
    final = hvd.allreduce(loss.detach(), op=hvd.Average, name="final_loss").item()
    context = ray.train.get_context()
    record = {"rank": hvd.rank(), "size": hvd.size(), "world_rank": context.get_world_rank(),
              "local_rank": hvd.local_rank(), "ray_local_rank": context.get_local_rank(), "loss": final,
              "weights": model.weight.detach().flatten().tolist(), "pid": os.getpid()}
    Path(config["out"], f"rank{hvd.rank()}.txt").write_text(repr(record))
    ray.train.report({"loss": final})


def test_ray_train_two_workers_end_with_the_same_loss(cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig

    from gpucomm.ray import GpucommConfig, GpucommTrainer

    trainer = GpucommTrainer(train_loop_per_worker, train_loop_config={"steps": 25, "out": str(tmp_path)},
                             gpucomm_config=GpucommConfig(timeout_s=60),
                             scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                             run_config=RunConfig(storage_path=str(tmp_path / "results"), name="gpucomm"))
    result = trainer.fit()
    assert result.error is None, result.error
    records = [eval(Path(tmp_path, f"rank{r}.txt").read_text()) for r in (0, 1)]  # noqa: S307 - written above
    for r, rec in enumerate(records):
        assert (rec["rank"], rec["world_rank"], rec["size"]) == (r, r, 2)
        assert rec["local_rank"] == rec["ray_local_rank"] == r
    print(f"\nRay Train final losses: rank 0 {records[0]['loss']!r}, rank 1 {records[1]['loss']!r}")
    assert records[0]["loss"] == records[1]["loss"]
    assert records[0]["weights"] == records[1]["weights"]
    deadline = time.monotonic() + 20
    while alive([rec["pid"] for rec in records]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive([rec["pid"] for rec in records]) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "ray", "-q"]))
