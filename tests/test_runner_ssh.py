"""gpucomm-run's remote path against a real OpenSSH server on 127.0.0.1.

The server is started by the fixture on a free port with throw-away host and user keys; the tests
skip with the reason when OpenSSH's server is not installed (``.ci/run`` installs it). A host
written ``user@127.0.0.1`` is always reached through ssh, so one machine exercises the remote path.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import textwrap
import time

import pytest

from tests.cluster import sshd_config
from tests.harness import PYTHON, free_port, launcher_cmd, run, started, write_script

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd")



@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    sshd_path = next((p for p in SSHD_CANDIDATES if os.path.exists(p)), shutil.which("sshd"))
    if sshd_path is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH server/client not installed (apt-get install openssh-server openssh-client; "
                    ".ci/run does this)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        keygen = run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], timeout=60)
        assert keygen.returncode == 0, keygen.stderr
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    last_error = ""
    for _ in range(5):  # a free port may be taken between the probe and sshd's bind: try again
        port = free_port()
        config = d / "sshd_config"
        config.write_text(sshd_config(port, "127.0.0.1", d, d / "sshd.pid"))
        ssh_args = ["-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR"]
        login = f"{getpass.getuser()}@127.0.0.1"
        # the module's tests run while it serves: its deadline covers them all
        with started([sshd_path, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, timeout=1800,
                     inherit_env=True) as server:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and server.proc.poll() is None:
                probe = run(["ssh", "-o", "BatchMode=yes", *ssh_args, "-p", str(port), "-i", str(d / "user_key"),
                             login, "true"], timeout=15)
                if probe.returncode == 0:
                    yield {"port": port, "key": str(d / "user_key"), "login": login, "args": " ".join(ssh_args)}
                    return
                last_error = probe.stderr
                time.sleep(0.2)
            server.proc.kill()
            last_error = (server.proc.communicate()[1] or "") + last_error
    pytest.skip(f"could not start a test sshd on 127.0.0.1: {last_error.strip()[-500:]}")


def _ssh_flags(sshd) -> list[str]:
    return ["-p", str(sshd["port"]), "-i", sshd["key"], "--ssh-args", sshd["args"]]


def test_remote_ranks_join_local_ones(sshd, tmp_path):
    hosts = f"localhost:1,{sshd['login']}:2"
    r = run(launcher_cmd("-np", "3", "-H", hosts, *_ssh_flags(sshd), PYTHON, "examples/hello_allreduce.py"),
            timeout=180)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "[0]<stdout>:rank 0/3 local 0/1 cross 0/2" in r.stdout
    assert "[1]<stdout>:rank 1/3 local 0/2 cross 1/2" in r.stdout
    assert "[2]<stdout>:rank 2/3 local 1/2 cross 0/1" in r.stdout
    assert "allreduce over 3 ranks OK" in r.stdout
    assert r.leftovers == []


def test_remote_rank_runs_in_the_same_directory_with_the_job_environment(sshd, tmp_path):
    script = write_script(tmp_path, "where.py", textwrap.dedent("""
        import os
        secret = os.environ["GPUCOMM_SECRET"]
        exposed = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if secret.encode() in f.read():
                            exposed.append(pid)
                except OSError:
                    pass
        print("cwd", os.getcwd(), "host", os.environ["GPUCOMM_HOSTNAME"], "mark", os.environ.get("MY_SETTING"),
              "secret on a command line:", exposed or "nowhere")
    """))
    r = run(launcher_cmd("-np", "2", "-H", f"localhost:1,{sshd['login']}:1", *_ssh_flags(sshd), PYTHON, str(script)),
            cwd=tmp_path, env={"MY_SETTING": "forwarded"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"[1]<stdout>:cwd {tmp_path} host 127.0.0.1 mark forwarded secret on a command line: nowhere" in r.stdout
    assert f"[0]<stdout>:cwd {tmp_path} host localhost mark forwarded secret on a command line: nowhere" in r.stdout


def test_remote_failure_stops_local_and_remote_ranks(sshd, tmp_path):
    script = write_script(tmp_path, "fail.py", textwrap.dedent("""
        import os, signal, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.setsid(); "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        if os.environ["GPUCOMM_RANK"] == "2":
            time.sleep(1.0)
            print("remote rank 2 gives up", file=sys.stderr)
            sys.exit(5)
        time.sleep(600)
    """))
    r = run(launcher_cmd("-np", "4", "-H", f"localhost:2,{sshd['login']}:2", "--stop-grace", "2", *_ssh_flags(sshd),
                         PYTHON, str(script)), timeout=120)
    assert r.returncode == 5, r.stderr
    assert f"job failed: rank 2 on {sshd['login']} exited with code 5" in r.stderr
    assert "  | remote rank 2 gives up" in r.stderr
    assert r.leftovers == []


def test_signal_stops_remote_ranks(sshd, tmp_path):
    script = write_script(tmp_path, "sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    r = run(launcher_cmd("-np", "2", "-H", f"{sshd['login']}:2", "--stop-grace", "2", *_ssh_flags(sshd),
                         PYTHON, str(script)),
            timeout=120, signal_after=(0.2, 15), wait_for_line="<stdout>:up", wait_count=2)
    assert r.returncode == 143, r.stderr
    assert r.leftovers == []


def test_unreachable_host_is_explained(sshd, tmp_path):
    r = run(launcher_cmd("-np", "1", "-H", f"{sshd['login']}:1", "-p", str(free_port()), "-i", sshd["key"],
                         "--ssh-args", sshd["args"], "--start-timeout", "5", PYTHON, "-c", "pass"), timeout=60)
    assert r.returncode == 255
    assert "exit code 255 is ssh's own: it could not reach or log in to" in r.stderr


# ---------------------------------------------------------------- the remote wrapper alone (no sshd needed)


@contextlib.contextmanager
def _wrapper(argv, cwd, env, grace=2.0):
    """The remote wrapper, given a request as the launcher sends it over ssh."""
    from gpucomm.runner.remote import encode_request

    with started([PYTHON, "-m", "gpucomm.runner.remote"], stdin=subprocess.PIPE, text=False, timeout=120) as wrapper:
        wrapper.proc.stdin.write(encode_request(argv, str(cwd), env, grace))
        wrapper.proc.stdin.flush()
        yield wrapper.proc


def test_wrapper_reports_a_missing_directory(tmp_path):
    with _wrapper([PYTHON, "-c", "pass"], tmp_path / "absent", dict(os.environ)) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 126
    assert b"cannot enter the launcher's working directory" in err and b"shared file system" in err


def test_wrapper_passes_exit_status_and_environment(tmp_path):
    with _wrapper([PYTHON, "-c", "import os, sys; print(os.getcwd(), os.environ['ONLY_IN_REQUEST']); sys.exit(4)"],
                  tmp_path, dict(os.environ, ONLY_IN_REQUEST="yes")) as proc:
        out = proc.stdout.read()  # stdin stays open: closing it means "stop the rank"
        assert proc.wait(timeout=60) == 4 and out.decode().split() == [str(tmp_path), "yes"]


def test_wrapper_stops_the_rank_when_the_connection_closes(tmp_path):
    import psutil

    marker = tmp_path / "child.pid"
    code = (f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    with _wrapper([PYTHON, "-c", code], tmp_path, dict(os.environ), grace=1.0) as proc:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the rank did not start"
            time.sleep(0.05)
        child = psutil.Process(int(marker.read_text()))
        proc.stdin.close()  # what the launcher does to stop a remote rank, and what a dropped connection looks like
        assert proc.wait(timeout=30) == 128 + 9  # SIGTERM ignored, so SIGKILL after the grace period
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
