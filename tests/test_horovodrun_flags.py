"""horovodrun flags that job files carry: each works in gpucomm-run or exits saying what to use instead."""

from __future__ import annotations

import re
import textwrap

import pytest

from gpucomm.runner.cli import build_parser, omp_threads, tunables_env
from gpucomm.runner.hosts import assign_slots, parse_hosts
from tests.harness import PYTHON, launcher_cmd, run, write_script


def _tunables(*flags: str) -> dict[str, str]:
    args = build_parser().parse_args([*flags, "-np", "1", "python", "x.py"])
    return tunables_env(args, {})


def test_accepted_flags_map_to_the_settings_they_mean():
    assert "GPUCOMM_CACHE_CAPACITY" not in _tunables("--gloo")
    assert _tunables("--disable-cache")["GPUCOMM_CACHE_CAPACITY"] == "0"
    assert _tunables("--tcp")["NCCL_IB_DISABLE"] == "1"
    zero = _tunables("--fusion-threshold-mb", "0")  # as HOROVOD_FUSION_THRESHOLD=0: fusion off
    assert zero["GPUCOMM_FUSION_THRESHOLD"] == zero["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert _tunables("--fusion-threshold-mb", "2")["GPUCOMM_FUSION_THRESHOLD"] == str(2 << 20)
    tuned = _tunables("--autotune", "--autotune-log-file", "tune.csv", "--autotune-warmup-samples", "0",
                      "--autotune-steps-per-sample", "4", "--autotune-bayes-opt-max-samples", "20")
    assert tuned["GPUCOMM_AUTOTUNE"] == tuned["HOROVOD_AUTOTUNE"] == "1"
    assert tuned["GPUCOMM_AUTOTUNE_LOG"].endswith("/tune.csv") and tuned["GPUCOMM_AUTOTUNE_WARMUP_SAMPLES"] == "0"
    assert tuned["GPUCOMM_AUTOTUNE_STEPS_PER_SAMPLE"] == "4" and "GPUCOMM_AUTOTUNE" not in _tunables("--gloo")
    with pytest.raises(SystemExit, match="steps-per-sample must be >= 2"):
        _tunables("--autotune", "--autotune-steps-per-sample", "1")


@pytest.mark.parametrize("flag,advice", [("--hierarchical-allreduce", "NCCL chooses"),
                                         ("--hierarchical-allgather", "leave the flag out"),
                                         ("--torus-allreduce", "no torus allreduce"),
                                         ("--mpi-threads-disable", "MPI_THREAD_MULTIPLE"),
                                         ("--jsrun", "-H/--hostfile"),
                                         ("--config-file", "GPUCOMM_*/HOROVOD_* variables")])
def test_refused_flags_say_what_to_do_instead(flag, advice, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([flag, "-np", "2", "python", "x.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpucomm-run: {flag}: ") and advice in err and "unrecognized" not in err


@pytest.mark.parametrize("flags", [("--no-hierarchical-allreduce",), ("--no-hierarchical-allgather",),
                                   ("--no-torus-allreduce",), ("--no-mpi-threads-disable",),
                                   ("--num-nccl-streams", "2"), ("--thread-affinity", "0")])
def test_flags_that_change_nothing_here_are_accepted_and_say_so(flags, capsys):
    """Issue 38: none of horovodrun's flags ends in a bare 'unrecognized arguments'."""
    args = build_parser().parse_args([*flags, "-np", "2", "python", "x.py"])
    assert args.np == 2 and args.command == ["python", "x.py"]
    err = capsys.readouterr().err
    assert err.startswith(f"gpucomm-run: {flags[0]}: accepted, no effect: "), err


def test_horovodrun_pairs_of_on_and_off_flags():
    assert "GPUCOMM_AUTOTUNE" not in _tunables("--autotune", "--no-autotune")  # the last one given wins
    assert _tunables("--no-autotune", "--autotune")["GPUCOMM_AUTOTUNE"] == "1"
    assert "GPUCOMM_TIMELINE_MARK_CYCLES" not in _tunables("--timeline-mark-cycles", "--no-timeline-mark-cycles")
    assert "GPUCOMM_STALL_CHECK_DISABLE" not in _tunables("--no-stall-check", "--stall-check")
    assert _tunables("--log-with-timestamp")["GPUCOMM_LOG_TIMESTAMP"] == "1"
    assert _tunables("--no-log-hide-timestamp")["GPUCOMM_LOG_TIMESTAMP"] == "1"
    assert _tunables("--log-without-timestamp")["GPUCOMM_LOG_TIMESTAMP"] == "0"
    assert _tunables("--log-hide-timestamp")["GPUCOMM_LOG_TIMESTAMP"] == "0"
    assert "GPUCOMM_LOG_TIMESTAMP" not in _tunables("--gloo")
    args = build_parser().parse_args(["--binding-args", "--bind-to none", "-np", "2", "python", "x.py"])
    assert args.binding_args == "--bind-to none"


def test_binding_args_need_an_mpi_launcher():
    r = run(launcher_cmd("-np", "1", "--binding-args", "--bind-to none", PYTHON, "-c", "pass"), timeout=60)
    assert r.returncode == 2 and "--binding-args needs --mpi" in r.stderr, r.stderr


def test_log_lines_start_with_the_time_when_asked():
    import logging

    from gpucomm.logs import configure_logging, log

    before = (log.level, list(log.handlers))
    try:
        configure_logging({"GPUCOMM_LOG_LEVEL": "INFO", "GPUCOMM_LOG_TIMESTAMP": "1"}, 3)
        record = logging.LogRecord("gpucomm", logging.INFO, __file__, 1, "hello", None, None)
        handler = next(h for h in log.handlers if getattr(h, "_gpucomm", False))
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ gpucomm rank 3 INFO gpucomm: hello$",
                        handler.format(record)), handler.format(record)
        configure_logging({"GPUCOMM_LOG_LEVEL": "INFO"}, 3)
        assert handler.format(record) == "gpucomm rank 3 INFO gpucomm: hello"
    finally:
        log.setLevel(before[0])
        log.handlers[:] = before[1]


def test_omp_threads_default_is_cores_per_local_rank_and_never_overrides_the_user(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    slots = assign_slots(parse_hosts("localhost:4"), 4)
    assert omp_threads({}, slots, []) == 4
    assert omp_threads({"OMP_NUM_THREADS": "3"}, slots, []) is None
    assert omp_threads({}, slots, ["node2"]) is None  # other hosts' cores are unknown here
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert omp_threads({}, assign_slots(parse_hosts("localhost:8"), 8), []) == 1


@pytest.mark.parametrize("size", [2, 3])
def test_a_job_with_horovodrun_flags_runs_with_timestamps_and_threads(tmp_path, size):
    script = write_script(tmp_path, "show.py", textwrap.dedent("""
        import os
        print("OMP", os.environ["OMP_NUM_THREADS"], "CACHE", os.environ["HOROVOD_CACHE_CAPACITY"], flush=True)
    """))
    env = {"OMP_NUM_THREADS": ""}  # unset for the launcher: it chooses
    r = run(launcher_cmd("-np", str(size), "--gloo", "--tcp", "--disable-cache", "--prefix-output-with-timestamp",
                         "--fusion-threshold-mb", "0", PYTHON, str(script)), timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "<stdout>:OMP" in line]
    assert len(lines) == size
    for line in lines:  # asctime, then horovodrun's rank prefix
        assert re.match(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[\d\]<stdout>:OMP \d+ CACHE 0$", line), line
    assert r.stderr.count("OMP_NUM_THREADS is not set") == 1
