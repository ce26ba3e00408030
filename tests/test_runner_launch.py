"""gpucomm-run end to end on this host: real jobs, real failures and signals, no leftover process."""

from __future__ import annotations

import re
import signal
import textwrap
import time

import gpucomm
from gpucomm.source_digest import source_digest
from tests.harness import PYTHON, ROOT, launcher_cmd, marked_processes, run, started, write_script

# A rank that starts a helper which leaves the rank's process group and ignores SIGTERM: only a
# SIGKILL found through the process tree (or the launcher's subreaper sweep) stops it.
STUBBORN_CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c",
                      "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(600)"])
""")


def test_four_ranks_run_the_example_on_cpu():
    r = run(launcher_cmd("-np", "4", PYTHON, "examples/hello_allreduce.py"))
    assert r.returncode == 0, r.stderr + r.stdout
    for rank in range(4):
        assert re.search(rf"^\[{rank}\]<stdout>:rank {rank}/4 local {rank}/4 cross 0/1 ", r.stdout, re.M), r.stdout
    assert "[0]<stdout>:allreduce over 4 ranks OK (sum of ranks = 6)" in r.stdout
    assert r.leftovers == []


def test_console_script_and_output_files(tmp_path):
    script = write_script(tmp_path, "talk.py", textwrap.dedent("""
        import os, sys
        r = os.environ["GPUCOMM_RANK"]
        print("out of", r, os.environ["HOROVOD_SIZE"], os.environ["PYTHONUNBUFFERED"])
        print("err of", r, file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """))
    exe = ROOT / ".venv" / "bin" / "gpucomm-run"
    cmd = [str(exe)] if exe.exists() else launcher_cmd()
    r = run(cmd + ["-np", "2", "--output-filename", str(tmp_path / "logs"), PYTHON, str(script)])
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:out of {rank} 2 1\n" in r.stdout
        assert f"[{rank}]<stdout>:no newline at the end\n" in r.stdout
        assert f"[{rank}]<stderr>:err of {rank}\n" in r.stderr
        folder = tmp_path / "logs" / f"rank.{rank}"
        assert (folder / "stdout").read_text() == f"out of {rank} 2 1\nno newline at the end\n"
        assert (folder / "stderr").read_text() == f"err of {rank}\n"


def test_failing_rank_stops_the_job_and_its_stubborn_children(tmp_path):
    script = write_script(tmp_path, "fail.py", STUBBORN_CHILD + textwrap.dedent("""
        rank = int(os.environ["GPUCOMM_RANK"])
        if rank == 2:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs SIGKILL
        print("up", flush=True)
        if rank == 1:
            time.sleep(1.0)
            print("something broke on rank 1", file=sys.stderr)
            sys.exit(7)
        time.sleep(600)
    """))
    r = run(launcher_cmd("-np", "4", "--stop-grace", "2", PYTHON, str(script)), timeout=120)
    assert r.returncode == 7, r.stderr
    assert "rank 1 on localhost exited with code 7; stopping the other 3 rank(s)" in r.stderr
    assert "  | something broke on rank 1" in r.stderr
    assert "job failed: rank 1 on localhost exited with code 7 (the first rank to fail)" in r.stderr
    assert r.leftovers == []  # within run()'s 120 s: rank 2 ignores SIGTERM, so SIGKILL after the grace ended it


def test_rank_killed_by_a_signal_is_reported(tmp_path):
    script = write_script(tmp_path, "die.py", textwrap.dedent("""
        import os, signal, time
        if os.environ["GPUCOMM_RANK"] == "0":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    """))
    r = run(launcher_cmd("-np", "2", "--stop-grace", "1", PYTHON, str(script)), timeout=60)
    assert r.returncode == 128 + 9
    assert "rank 0 on localhost was killed by SIGKILL" in r.stderr and "out-of-memory" in r.stderr
    assert r.leftovers == []


def test_integrated_failure_reports_the_real_error_first(tmp_path):
    """A gpucomm job where one rank raises: the job ends with that rank's exception, not a hang."""
    script = write_script(tmp_path, "boom.py", textwrap.dedent("""
        import torch
        import gpucomm.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(2))
        if hvd.rank() == 1:
            raise ValueError("bad batch on rank 1")
        hvd.allreduce(torch.ones(2))  # rank 0 waits here until it is stopped
    """))
    r = run(launcher_cmd("-np", "2", "--stop-grace", "3", PYTHON, str(script)), timeout=90)
    assert r.returncode == 1
    assert "ValueError: bad batch on rank 1" in r.stderr
    # rank 0's echo of the failure (its collective loses the peer) may exit first; the report still
    # names rank 1, whose exception reached the store first
    assert re.search(r"job failed: rank 1 on localhost (exited with code 1|raised the job's first error \(ValueError: "
                     r"bad batch on rank 1\))", r.stderr), r.stderr
    assert r.leftovers == []


def test_root_cause_is_named_even_when_another_rank_exits_first(tmp_path):
    script = write_script(tmp_path, "late.py", textwrap.dedent("""
        import sys, time
        import torch
        import gpucomm.torch as hvd

        def slow_hook(*exc_info):  # rank 1 prints its traceback, then takes its time to die
            sys.__excepthook__(*exc_info)
            time.sleep(30)

        sys.excepthook = slow_hook
        hvd.init()
        hvd.allreduce(torch.ones(2))
        if hvd.rank() == 1:
            raise RuntimeError("root cause on rank 1")
        time.sleep(1.5)
        sys.exit(9)  # rank 0 exits first, with its own code
    """))
    r = run(launcher_cmd("-np", "2", "--stop-grace", "2", PYTHON, str(script)), timeout=90)
    assert r.returncode == 9, r.stderr
    assert "rank 1 on localhost failed first: RuntimeError: root cause on rank 1" in r.stderr
    assert "(rank 0 exited before it, with code 9, after that failure)" in r.stderr
    assert "job failed: rank 1 on localhost raised the job's first error (RuntimeError: root cause on rank 1)" \
        in r.stderr
    assert r.leftovers == []


def _sleepers(tmp_path):
    return write_script(tmp_path, "sleepers.py", STUBBORN_CHILD + textwrap.dedent("""
        print("up", os.environ["GPUCOMM_RANK"], flush=True)
        time.sleep(600)
    """))


def test_ctrl_c_stops_every_rank(tmp_path):
    r = run(launcher_cmd("-np", "3", "--stop-grace", "2", PYTHON, str(_sleepers(tmp_path))), timeout=60,
            signal_after=(0.2, signal.SIGINT), wait_for_line="<stdout>:up", wait_count=3)
    assert r.returncode == 130, r.stderr
    assert "received SIGINT; stopping all 3 running rank(s)" in r.stderr
    assert r.leftovers == []


def test_sigterm_stops_every_rank(tmp_path):
    r = run(launcher_cmd("-np", "2", "--stop-grace", "2", PYTHON, str(_sleepers(tmp_path))), timeout=60,
            signal_after=(0.2, signal.SIGTERM), wait_for_line="<stdout>:up", wait_count=2)
    assert r.returncode == 143, r.stderr
    assert r.leftovers == []


def test_children_left_by_a_successful_job_are_stopped(tmp_path):
    script = write_script(tmp_path, "leaky.py", STUBBORN_CHILD + "print('done')\n")
    r = run(launcher_cmd("-np", "2", "--stop-grace", "1", PYTHON, str(script)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.leftovers == []


def test_missing_program_is_a_clear_error():
    r = run(launcher_cmd("-np", "2", "no-such-program-xyz"), timeout=60)
    assert r.returncode == 127
    assert "rank 0 on localhost could not be started: cannot run 'no-such-program-xyz'" in r.stderr
    assert r.leftovers == []


def test_usage_errors():
    r = run(launcher_cmd("-np", "5", "-H", "localhost:2", PYTHON, "-c", "pass"), timeout=60)
    assert r.returncode == 2 and "asks for more processes than the 2 slots" in r.stderr
    r = run(launcher_cmd(PYTHON, "-c", "pass"), timeout=60)
    assert r.returncode == 2 and "-np is required" in r.stderr
    r = run(launcher_cmd("-np", "1"), timeout=60)
    assert r.returncode == 2 and "no command given" in r.stderr


def test_version_and_check_build():
    r = run(launcher_cmd("--version"), timeout=60)
    assert r.returncode == 0 and re.match(r"gpucomm-run \d+\.\d+", r.stdout)
    r = run(launcher_cmd("--check-build"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[X] PyTorch" in r.stdout and "[X] Gloo" in r.stdout
    assert r.stdout.startswith(f"gpucomm v{gpucomm.__version__} (sources {source_digest()}: "), r.stdout  # per host
    assert re.search(r"\[(X| )\] (NCCL|nccl)", r.stdout) and re.search(r"\[(X| )\] (\d+ GPU|gpus)", r.stdout)
    assert "Numba" in r.stdout or "numba_cuda" in r.stdout


def test_single_gpu_test_mode_reaches_the_ranks(tmp_path):
    script = write_script(tmp_path, "env.py", "import os; print('mode', os.environ.get('GPUCOMM_SINGLE_GPU_TEST'))\n")
    r = run(launcher_cmd("-np", "2", "--single-gpu-test", PYTHON, str(script)), timeout=60)
    assert r.returncode == 0 and r.stdout.count("mode 1") == 2


def test_second_ctrl_c_kills_at_once(tmp_path):
    import time


    script = write_script(tmp_path, "deaf.py", textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(600)
    """))
    with started(launcher_cmd("-np", "2", "--stop-grace", "60", PYTHON, str(script)), timeout=120) as job:
        proc = job.proc
        ups = 0
        while ups < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            ups += "<stdout>:up" in line
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # the ranks ignore SIGTERM; without this the grace would be 60 s
        _, err = proc.communicate(timeout=30)  # well inside the 60 s grace: the second signal cut it short
    assert proc.returncode == 130, err
    assert "second signal: killing all ranks now." in err
    assert job.leftovers == []


def test_a_killed_rank_is_blamed_not_the_ranks_that_noticed(tmp_path):
    """3 ranks, rank 2 SIGKILLed mid-step: ranks 0 and 1 then fail their collective and report it; the
    summary still names rank 2, the rank that died first."""
    script = write_script(tmp_path, "killed.py", textwrap.dedent("""
        import os, signal, time
        import torch
        import gpucomm.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(2))
        if hvd.rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(100):
            hvd.allreduce(torch.ones(2))
            time.sleep(0.1)
    """))
    r = run(launcher_cmd("-np", "3", "--stop-grace", "3", PYTHON, str(script)), timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert "job failed: rank 2 on localhost was killed by SIGKILL" in last, r.stderr
    assert "failed first" not in r.stderr, r.stderr
    assert r.returncode == 128 + 9 and r.leftovers == []


def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    """SIGKILL to the launcher alone (it cannot stop anything): its ranks still end, within seconds."""
    script = write_script(tmp_path, "sleepy.py", textwrap.dedent("""
        import time
        print("up", flush=True)
        time.sleep(600)
    """))
    with started(launcher_cmd("-np", "2", PYTHON, str(script)), stderr=None, timeout=180) as job:
        launcher, mark = job.proc, job.mark
        for _ in range(2):
            assert "up" in launcher.stdout.readline()
        ranks = [p for p in marked_processes(mark) if p.pid != launcher.pid]
        assert len(ranks) >= 2
        launcher.kill()
        launcher.wait(timeout=30)
        t0 = time.monotonic()
        while marked_processes(mark) and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        left = marked_processes(mark)
        assert not left, [p.pid for p in left]
        print(f"ranks gone {gone_after:.2f} s after the launcher's SIGKILL")


def test_after_a_stall_shutdown_the_job_ends_at_once_and_says_so_once(tmp_path):
    script = write_script(tmp_path, "stall.py", textwrap.dedent("""
        import time
        import torch
        import gpucomm.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            time.sleep(600)  # never submits: rank 0's allreduce stalls
        try:
            hvd.allreduce(torch.ones(2), name="forgotten")
        except Exception:
            print("RAISED", flush=True)
            t0 = time.monotonic()
            hvd.shutdown()
            print(f"SHUTDOWN_S {time.monotonic() - t0:.2f}", flush=True)
            raise
    """))
    env = {"GPUCOMM_STALL_CHECK_TIME_SECONDS": "1", "GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    r = run(launcher_cmd("-np", "2", "--stop-grace", "2", PYTHON, str(script)), timeout=120, env=env)
    assert "RAISED" in r.stdout, r.stdout + r.stderr
    assert re.search(r"SHUTDOWN_S \S+", r.stdout), r.stdout  # the figure itself is for the note, not asserted
    assert "shutting down after a failure: waiting at most 1 s" in r.stderr, r.stderr  # not the 10 s grace
    after = r.stderr.split("stall inspector stopped the job", 1)[1]
    assert "The job stops with an error after" not in after, "stall warnings went on after the shutdown"
    assert r.stderr.count("gpucomm: the stall inspector stopped the job") == 1, r.stderr
    assert r.leftovers == []
