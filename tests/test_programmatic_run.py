"""``gpucomm.run`` keeps ``horovod.run``'s contract: ``func(*args, **kwargs)`` runs in N ranks, the
results come back ordered by rank, a failing rank's exception and traceback come back as the
error, and no process outlives the call.

Each job is driven from a fresh interpreter (``harness.run``: a deadline, and every process the job
started is found by its mark afterwards), with closures defined in the driver's ``__main__`` (they
travel by value through cloudpickle) calling functions of tests/ranks/programmatic_scenarios.py (which
the ranks import by reference).
"""

from __future__ import annotations

import inspect
import json
import threading

import pytest

import gpucomm
from gpucomm.runner.programmatic import RunError
from tests.ranks.api_parity_scenarios import param_problems, resolver
from tests.harness import PYTHON, run, write_script
from tests.horovod_torch_api import P

# horovod.run's parameters at v0.28.1 (horovod/runner/__init__.py), in order.
HOROVOD_RUN = (P("func"), P("args", ()), P("kwargs", None), P("num_proc", 1), P("min_num_proc", None),
               P("max_num_proc", None), P("slots", None), P("reset_limit", None), P("cooldown_range", None),
               P("hosts", None), P("hostfile", None), P("host_discovery_script", None), P("start_timeout", None),
               P("ssh_port", None), P("ssh_identity_file", None), P("disable_cache", None),
               P("output_filename", None), P("verbose", None), P("use_gloo", None), P("use_mpi", None),
               P("mpi_args", None), P("network_interface", None), P("network_interfaces", None),
               P("executable", None), P("np", None), P("min_np", None), P("max_np", None))

RESULTS_DRIVER = """
import json, sys
import gpucomm
from tests.ranks import programmatic_scenarios as scenarios

size = int(sys.argv[1])
offset = 1000  # captured by the closure below


def closure(scale, weight):
    out = scenarios.rank_sum_and_env()
    out["value"] = offset + weight(out["rank"]) * scale
    print(f"hello from rank {out['rank']}", flush=True)
    return out


results = gpucomm.run(closure, args=(3,), kwargs={"weight": lambda r: r * r + 1}, num_proc=size, start_timeout=45,
                      output_filename=sys.argv[2])
print("RESULT " + json.dumps(results))
"""

FAILURE_DRIVER = """
import json, sys
import gpucomm
from gpucomm.runner.programmatic import RunError
from tests.ranks import programmatic_scenarios as scenarios

size, how = int(sys.argv[1]), sys.argv[2]
marker = "marker-" + how


def raising():
    return scenarios.fail_on_last_rank(marker)


def exiting():
    return scenarios.exit_without_raising(7)


try:
    gpucomm.run(raising if how == "raise" else exiting, np=size)
except RunError as e:
    print("ERROR " + json.dumps({"rank": e.rank, "runtime_error": isinstance(e, RuntimeError),
                                 "cause": type(e.__cause__).__name__, "exception": repr(e.exception),
                                 "exit_code": e.exit_code, "text": str(e)}))
else:
    print("NO ERROR")
"""


def _line(stdout: str, tag: str):
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    assert lines, f"the driver printed no {tag} line:\n{stdout}"
    return json.loads(lines[-1][len(tag) + 1:])


@pytest.mark.parametrize("size", [2, 3])
def test_results_come_back_ordered_by_rank(tmp_path, size):
    """A closure (with a lambda among its kwargs) runs in every rank, calls collectives, and its
    return values come back in rank order; start_timeout and output_filename reach the ranks."""
    driver = write_script(tmp_path, "driver.py", RESULTS_DRIVER)
    res = run([PYTHON, str(driver), str(size), str(tmp_path / "out")], timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.leftovers == []
    results = _line(res.stdout, "RESULT")
    assert [r["rank"] for r in results] == list(range(size))
    for rank, r in enumerate(results):
        assert r["size"] == size
        assert r["total"] == sum(range(1, size + 1))
        assert r["gathered"] == [10 * i for i in range(size)]
        assert r["value"] == 1000 + (rank * rank + 1) * 3
        assert r["start_timeout"] == "45"
    assert len({r["pid"] for r in results}) == size
    for rank in range(size):
        assert f"[{rank}]<stdout>:hello from rank {rank}" in res.stdout
        assert (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text() == f"hello from rank {rank}\n"


@pytest.mark.parametrize("size", [2, 3])
def test_a_failing_rank_raises_with_its_traceback(tmp_path, size):
    """The last rank raises while the others wait in a collective: the error names that rank and
    carries its exception and traceback, not the others' echoes; nothing is left running."""
    driver = write_script(tmp_path, "driver.py", FAILURE_DRIVER)
    res = run([PYTHON, str(driver), str(size), "raise"], timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.leftovers == []
    err = _line(res.stdout, "ERROR")
    assert err["rank"] == size - 1
    assert err["runtime_error"] and err["cause"] == "ValueError"
    assert err["exception"] == f"ValueError('marker-raise on rank {size - 1}')"
    assert f"Traceback of rank {size - 1}" in err["text"]
    assert "programmatic_scenarios.py" in err["text"] and "in fail_on_last_rank" in err["text"]


def test_a_rank_that_dies_without_raising_is_named(tmp_path):
    """Rank 0 ends its process with os._exit(7): the error names it and its exit code, although
    the other rank stored an exception (its collective lost its peer) afterwards."""
    driver = write_script(tmp_path, "driver.py", FAILURE_DRIVER)
    res = run([PYTHON, str(driver), "2", "exit"], timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.leftovers == []
    err = _line(res.stdout, "ERROR")
    assert err["rank"] == 0 and err["exit_code"] == 7, err
    assert "exited with code 7" in err["text"]


@pytest.mark.parametrize("kwargs, error", [
    ({"min_num_proc": 2}, NotImplementedError),
    ({"min_np": 2}, NotImplementedError),
    ({"max_num_proc": 4}, NotImplementedError),
    ({"host_discovery_script": "./discover.sh"}, NotImplementedError),
    ({"mpi_args": "--bind-to none"}, ValueError),
    ({"use_mpi": True, "use_gloo": True}, ValueError),
    ({"hosts": "localhost:2", "hostfile": "hosts.txt"}, ValueError),
    ({"num_proc": 0}, ValueError),
    ({"num_proc": 3, "hosts": "localhost:2"}, ValueError),
    ({"args": (threading.Lock(),)}, TypeError),
])
@pytest.mark.filterwarnings("ignore:min_np is deprecated:DeprecationWarning")
def test_what_cannot_run_is_refused_before_anything_starts(kwargs, error):
    with pytest.raises(error) as info:
        gpucomm.run(abs, **kwargs)
    assert str(info.value).startswith("gpucomm.run") or "gpucomm.run" in str(info.value)
    assert len(str(info.value)) > 40


def test_signature_matches_horovod_run():
    assert param_problems(HOROVOD_RUN, inspect.signature(gpucomm.run), resolver(gpucomm)) == []
    assert issubclass(RunError, RuntimeError)


def test_import_gpucomm_stays_light():
    code = ("import sys, gpucomm; gpucomm.run; import gpucomm.runner.cli, gpucomm.runner.run_task; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    res = run([PYTHON, "-c", code], timeout=60)
    assert res.returncode == 0, res.stderr


MPI_DRIVER = """
import json, sys
import gpucomm
from gpucomm.errors import RunError
from tests.ranks import programmatic_scenarios as scenarios

size, how = int(sys.argv[1]), sys.argv[2]
if how == "results":
    print("RESULT " + json.dumps(gpucomm.run(scenarios.collectives_on_mpi, num_proc=size, use_mpi=True)))
else:
    try:
        gpucomm.run(scenarios.fail_on_last_rank, args=("marker-mpi",), num_proc=size, use_mpi=True)
    except RunError as e:
        print("ERROR " + json.dumps({"rank": e.rank, "cause": type(e.__cause__).__name__, "text": str(e)}))
    else:
        print("NO ERROR")
"""


@pytest.mark.parametrize("how", ["results", "raise"])
def test_use_mpi_starts_the_ranks_through_mpis_launcher(tmp_path, how):
    """``horovod.run(use_mpi=True)`` as ``gpucomm-run --mpi``: MPI's launcher starts the ranks, their
    CPU collectives run on MPI (counted), results come back by rank, and a rank's exception comes
    back with its traceback."""
    from tests.test_mpi_backend import launcher

    found = launcher("mpich")  # skips without mpi4py or MPICH's mpiexec
    driver = write_script(tmp_path, "driver.py", MPI_DRIVER)
    res = run([PYTHON, str(driver), "2", how], timeout=240, env={"GPUCOMM_MPIEXEC": found.path})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.leftovers == []
    if how == "results":
        results = _line(res.stdout, "RESULT")
        assert [(r["rank"], r["size"], r["total"], r["mpi_rank_var"]) for r in results] == \
            [(0, 2, 3.0, "0"), (1, 2, 3.0, "1")], results
        assert all(r["mpi"] > 0 and r["gloo"] == 0 for r in results), results
    else:
        err = _line(res.stdout, "ERROR")
        assert err["rank"] == 1 and err["cause"] == "ValueError", err
        assert "marker-mpi on rank 1" in err["text"] and "Traceback of rank 1" in err["text"]
