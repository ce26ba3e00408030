"""Whole jobs with their CPU collectives on MPI: the multi-rank scenarios the Gloo suite runs
(every collective and dtype, mismatches, ordering, join, the optimizer, process sets, a stall, a
rank that leaves or dies) pass under ``gpucomm-run --mpi`` too, and the counters show that MPI,
not Gloo, carried their data. One 3-rank MPI job runs the scenarios in sequence (rank side:
``tests/ranks/mpi_scenarios.py``), so the whole module costs two launches. Elastic jobs are not
here: they stay on Gloo (an MPI communicator cannot change its ranks)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.harness import PYTHON, ROOT, launcher_cmd, run
from tests.ranks import control_scenarios as sc
from tests.ranks.mpi_scenarios import SCENARIOS
from tests.test_mpi_backend import launcher

SIZE = 3
DATA_PLANE = ("allreduce", "data_movement", "reducescatter", "out_of_order", "join_uneven_steps",
              "train_uneven_then_join", "static_process_sets", "async_and_barrier", "autograd")  # scenarios whose tensors go through the backend


def _gpucomm_run_mpi(np: int, *argv: str, timeout: float, env: dict | None = None) -> tuple:
    found = launcher("mpich")  # skips without mpi4py or MPICH's mpiexec
    return run(launcher_cmd("--mpi", "-np", str(np), PYTHON, *argv), timeout=timeout,
               env={"GPUCOMM_MPIEXEC": found.path, **(env or {})})


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    """Each rank's per-scenario results from one MPI job running every scenario in turn."""
    folder = tmp_path_factory.mktemp("mpi_jobs")
    r = _gpucomm_run_mpi(SIZE, str(ROOT / "tests" / "ranks" / "mpi_scenarios.py"), str(folder), *SCENARIOS,
                         timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.leftovers == []
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(SIZE)]


def _values(outcomes: list[dict], name: str) -> list:
    """Scenario ``name``'s return value on every rank (its traceback fails the test)."""
    values = []
    for rank, per_rank in enumerate(outcomes):
        status, value = per_rank[name]["outcome"]
        assert status == "ok", f"rank {rank}, scenario {name}:\n{value}"
        values.append(value)
    return values


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_passes_with_cpu_collectives_on_mpi(outcomes, name):
    _values(outcomes, name)
    issued = [per_rank[name] for per_rank in outcomes]
    assert all(x["gloo"] == 0 for x in issued), issued  # no CPU collective went to Gloo
    if name in DATA_PLANE:
        assert all(x["mpi"] > 0 for x in issued), issued


def test_horovods_queries_say_the_job_is_on_mpi(outcomes):
    assert _values(outcomes, "horovod_queries") == [[True, True, False, True]] * SIZE


def test_mismatches_raise_the_same_error_on_every_rank(outcomes):
    seen = _values(outcomes, "mismatches")
    messages = [{case: message for case, (_, _, message) in s.items()} for s in seen]
    assert all(m == messages[0] for m in messages)  # every rank got the very same explanation
    assert "root ranks: ranks 0, 2 sent 0; rank 1 sent 1." in seen[0]["root"][2]
    assert "tensor shapes: ranks 0, 2 sent [6000]; rank 1 sent [6001]." in seen[0]["shape-big"][2]
    assert all(kind == "CollectiveError" for _, kind, _ in seen[0].values())


def test_join_and_the_optimizer_with_uneven_steps(outcomes):
    assert _values(outcomes, "join_uneven_steps") == [SIZE - 1] * SIZE
    want = sc.reference_training({r: 4 + r for r in range(SIZE)}, SIZE)
    for last, params in _values(outcomes, "train_uneven_then_join"):
        assert last == SIZE - 1
        for got, expected in zip(params, want):
            assert torch.allclose(torch.tensor(got), expected, atol=1e-6), (got, expected)
    for _, errors in _values(outcomes, "join_then_data_movement")[1:]:
        for kind in ("allgather", "broadcast", "alltoall"):
            assert "rank 0 already called join()" in errors[kind], errors


def test_process_sets_and_an_optimizer_on_a_subset(outcomes):
    static = _values(outcomes, "static_process_sets")
    assert "Rank 1 is not a member of the provided process set [0, 2]" in static[1]["non_member"]
    want = sc.reference_training({1: 3, 2: 3}, SIZE, members=[1, 2])
    for rank in (1, 2):
        assert all(torch.allclose(torch.tensor(g), w, atol=1e-6) for g, w in zip(static[rank]["params"], want))
    for seen in _values(outcomes, "dynamic_process_sets"):
        assert "already registered (id 1)" in seen["duplicate"] and "in flight (allreduce.busy)" in seen["busy"]


def test_a_stall_and_a_departed_rank_end_the_waits_with_the_cause(outcomes):
    for seen in _values(outcomes, "stall_shutdown"):
        assert "the stall inspector stopped the job after 3 s" in seen["error"] and seen["later"] == seen["error"]
    waited = _values(outcomes, "shutdown_while_others_wait")
    assert waited[1] is None and all("rank 1 has shut gpucomm down" in w["error"] for w in waited[::2])


def test_a_rank_that_dies_fails_the_waiting_rank_with_its_error():
    r = _gpucomm_run_mpi(2, "-m", "tests.ranks.control_scenarios", "dies_while_others_wait", "raise", "1", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(re.search(r"\[0\]<stdout>:(\{.*\})", r.stdout).group(1))
    assert report["error"] == report["later"] == "rank 1 failed: ValueError: rank 1 gave up", report
    assert "gpucomm-run: rank 1 on" in r.stderr and "failed first: ValueError: rank 1 gave up" in r.stderr
    assert r.leftovers == []


def test_a_name_in_flight_twice_is_refused_on_the_rank_that_reused_it(outcomes):
    messages = _values(outcomes, "duplicate_name")
    assert "another operation named 'allreduce.dup' is still in flight on this rank" in messages[0]
    assert messages[1:] == [None] * (SIZE - 1)


def test_cached_bursts_cost_a_few_control_rounds(outcomes):
    for rank, per_mode in enumerate(_values(outcomes, "cache_bursts")):
        for mode, bursts in per_mode.items():
            assert len(bursts) == 2 and all(1 <= f <= 3 for f in bursts), (rank, mode, bursts)


def test_a_stall_is_reported_and_the_job_recovers(outcomes):
    warnings = _values(outcomes, "stall_warning_then_recover")[0]["warnings"]
    assert any("allreduce.forgotten: waiting" in w and "1: [allreduce.forgotten]" in w for w in warnings), warnings


def test_an_early_join_is_no_stall(outcomes):
    lasts = _values(outcomes, "early_join_under_stall_shutdown")
    assert len(set(lasts)) == 1 and lasts[0] != 0, lasts  # the same on every rank; rank 0 joined first


RAN_FEWER = ("import json; from tests.ranks.optimizer_scenarios import ran_fewer_steps; "
             "print('RESULT ' + json.dumps(ran_fewer_steps(1)), flush=True)")


def test_a_rank_that_ran_fewer_steps_is_named_without_waiting_for_the_timeout():
    """On MPI no reset ends the step's allreduce that a rank which shut gpucomm down never runs: rank 0
    waited for GPUCOMM_TIMEOUT (here 600 s: the test's own limit would end first). Rank 1 never launched
    that step (it says how many it launched as it leaves), so rank 0's step fails at once, naming it and
    hvd.join()."""
    r = _gpucomm_run_mpi(2, "-c", RAN_FEWER, timeout=120, env={"GPUCOMM_TIMEOUT": "600"})
    found = re.search(r"\[0\]<stdout>:RESULT (.*)", r.stdout)
    assert found, r.stdout[-3000:] + r.stderr[-3000:]
    error = json.loads(found.group(1))
    assert "rank 1 shut gpucomm down (hvd.shutdown(), or its script ended)" in error, error
    assert "DistributedOptimizer.bucket." in error and "hvd.join()" in error, error
    assert r.leftovers == []
