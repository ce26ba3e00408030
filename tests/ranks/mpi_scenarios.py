"""The Gloo suite's multi-rank scenarios, run in sequence inside one MPI job (``gpucomm-run --mpi``),
so that every one of them runs with its CPU collectives on MPI (``tests/test_mpi_scenarios.py``).

``python mpi_scenarios.py OUT_DIR NAME...`` runs the named scenarios in order in this rank, each
with its own environment (set before its ``hvd.init()``) and cleaned up afterwards as the test
harness's pool does; every rank writes ``OUT_DIR/rank<r>.json``: per scenario, its outcome (the
scenario's return value, or the traceback) and the counters that show which CPU transport ran.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from gpucomm import job as jobs
from gpucomm.counters import stats
from gpucomm.torch import submission
from tests.ranks import collective_checks as checks
from tests.ranks import control_scenarios as control

DATA_PLANE = {"GPUCOMM_INLINE_BYTES": "0"}  # small allreduces through MPI too, not the coordinator
STALL = {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS": "3"}

def horovod_queries() -> list:
    """Horovod's build and transport queries in a job on MPI."""
    import gpucomm.torch as hvd

    hvd.init()
    return [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.mpi_threads_supported()]


SCENARIOS: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {
    "horovod_queries": (horovod_queries, {}),
    "allreduce": (checks.check_allreduce, DATA_PLANE),
    "data_movement": (checks.check_data_movement, DATA_PLANE),
    "reducescatter": (checks.check_reducescatter, DATA_PLANE),
    "mismatches": (control.mismatches, {}),
    "out_of_order": (control.out_of_order, {}),
    "join_uneven_steps": (control.join_uneven_steps, {}),
    "join_then_data_movement": (control.join_then_data_movement, {}),
    "train_uneven_then_join": (control.train_uneven_then_join, {}),
    "static_process_sets": (control.static_process_sets, {}),
    "dynamic_process_sets": (control.dynamic_process_sets, {}),
    "stall_shutdown": (control.stall_shutdown, STALL),
    "shutdown_while_others_wait": (control.shutdown_while_others_wait, {}),
    "async_and_barrier": (checks.check_async_and_barrier, DATA_PLANE),
    "autograd": (checks.check_autograd, DATA_PLANE),
    "duplicate_name": (control.duplicate_name, {}),
    "cache_bursts": (control.cache_bursts, {"GPUCOMM_CYCLE_TIME": "10000"}),
    "stall_warning_then_recover": (control.stall_warning_then_recover, {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1"}),
    "early_join_under_stall_shutdown": (control.early_join_under_stall_shutdown, STALL),
}


def _clean_up() -> None:
    """What a scenario may leave behind (as the pool's reset, but the init count goes on: every
    rank inits alike, and the next job's store keys must not meet this one's): a job, handles, log
    captures."""
    if jobs.is_initialized():
        jobs.shutdown()
    submission.clear_handles()
    captured = logging.getLogger("gpucomm.control")  # the scenarios' log captures
    for handler in list(captured.handlers):
        captured.removeHandler(handler)


def run(names: list[str]) -> dict[str, Any]:
    """Run ``names`` in order; per scenario: ``outcome`` (["ok", value] or ["error", traceback]) and
    the CPU collectives it issued on each transport."""
    base = dict(os.environ)
    out: dict[str, Any] = {}
    for name in names:
        fn, env = SCENARIOS[name]
        os.environ.update(env)
        stats(reset=True)
        try:
            outcome: list[Any] = ["ok", fn()]
        except BaseException:  # noqa: BLE001 - reported to the test, with the traceback
            outcome = ["error", traceback.format_exc()]
        try:
            _clean_up()
        except BaseException:  # noqa: BLE001
            outcome = ["error", "cleanup failed:\n" + traceback.format_exc()]
        counts = stats()
        os.environ.clear()
        os.environ.update(base)
        out[name] = {"outcome": outcome, "mpi": counts["mpi_collectives"], "gloo": counts["gloo_collectives"]}
    return out


def main(argv: list[str]) -> None:
    folder, names = Path(argv[0]), argv[1:]
    rank = os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]
    results = run(names)
    (folder / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
