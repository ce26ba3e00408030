"""Issue 26: trust at the edges. Secrets that hold (or a warning that says they do not), a store that
binds only what it announces, one process per rank, and a store whose memory is bounded. Jobs run
as real processes (``tests/ranks/trust_programs.py``) through ``tests.harness.run``."""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from pathlib import Path

import pytest

from gpucomm.control.channel import ControlError, ControlListener, connect
from gpucomm.errors import GpucommError
from tests.harness import PYTHON, free_port, run

PROGRAMS = "tests/ranks/trust_programs.py"
WARNING = "accepts any process that can reach"
DUPLICATE = "two processes claim rank"


def _horovod_env(rank: int, size: int, port: int, secret: str | None = None, **extra: str) -> dict[str, str]:
    """What a manual (Horovod-style) launch on this host sets: no launcher of ours, rank 0 serves the store."""
    env = {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size), "HOROVOD_LOCAL_RANK": str(rank),
           "HOROVOD_LOCAL_SIZE": str(size), "GPUCOMM_RENDEZVOUS_ADDR": "127.0.0.1",
           "GPUCOMM_RENDEZVOUS_PORT": str(port), "GPUCOMM_TIMEOUT": "60", "GPUCOMM_START_TIMEOUT": "30"}
    if secret is not None:
        env["GPUCOMM_SECRET"] = secret
    env.update(extra)
    return env


def _drive(tmp_path: Path, procs: list[dict], timeout: float = 150) -> list[dict]:
    """Run ``procs`` (role, env, wave) through the driver; each one's code, stdout and stderr."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"procs": procs, "timeout": timeout - 30}))
    r = run([PYTHON, PROGRAMS, "driver", str(spec)], timeout=timeout)
    assert r.leftovers == [], r.leftovers
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, r.stdout + r.stderr
    return json.loads(line[len("RESULTS "):])


def _proc(role: str, env: dict[str, str], wave: int = 0, unset: tuple[str, ...] = ("GPUCOMM_SECRET",)) -> dict:
    return {"role": role, "env": env, "wave": wave, "unset": list(unset)}


def _line(result: dict, tag: str) -> str:
    found = [x for x in result["stdout"].splitlines() if x.startswith(tag + " ")]
    assert found, f"no {tag} line:\n{result['stdout']}\n{result['stderr']}"
    return found[0][len(tag) + 1:]


# ------------------------------------------------------------------------------------------------
# 1. secrets that hold


def test_without_a_secret_rank_0_warns_once_that_anyone_can_reach_the_store(tmp_path):
    port = free_port()
    results = _drive(tmp_path, [_proc("twice", _horovod_env(r, 2, port)) for r in range(2)])
    for r, res in enumerate(results):
        assert res["code"] == 0 and f"OK {r}" in res["stdout"], res
    rank0, rank1 = results[0]["stderr"], results[1]["stderr"]
    assert rank0.count(WARNING) == 1, rank0  # two init()s in the process, one warning
    warning = next(x for x in rank0.splitlines() if WARNING in x)
    assert f"store at 127.0.0.1:{port} {WARNING} 127.0.0.1:{port}" in warning, warning
    assert "export GPUCOMM_SECRET=" in warning and "GPUCOMM_REQUIRE_SECRET=1" in warning, warning
    assert WARNING not in rank1, rank1


def test_require_secret_turns_the_warning_into_an_error_on_every_rank(tmp_path):
    port = free_port()
    results = _drive(tmp_path, [_proc("twice", _horovod_env(r, 2, port, GPUCOMM_REQUIRE_SECRET="1"))
                                for r in range(2)])
    for res in results:
        assert res["code"] != 0, res
        assert "GPUCOMM_REQUIRE_SECRET=1 but GPUCOMM_SECRET is not set" in res["stderr"], res["stderr"]
        assert f"reach 127.0.0.1:{port} can compute" in res["stderr"], res["stderr"]


# ------------------------------------------------------------------------------------------------
# 2. bind what you announce


def test_a_loopback_rendezvous_address_binds_loopback_only(tmp_path):
    port, secret = free_port(), secrets.token_hex(32)
    results = _drive(tmp_path, [_proc("listening", _horovod_env(r, 2, port, secret)) for r in range(2)])
    assert all(res["code"] == 0 for res in results), results
    assert _line(results[0], "LISTENING") == "127.0.0.1", results[0]
    assert WARNING not in results[0]["stderr"]  # a secret was given: nothing to warn about


def test_bind_address_is_the_announced_one_or_a_clear_error():
    from gpucomm.bootstrap.arrival import BIND_VAR, bind_address

    assert bind_address("127.0.0.1", all_local=True) == "127.0.0.1"
    assert bind_address("localhost", all_local=True) == "127.0.0.1"
    # ranks on other hosts would look for the store on their own loopback (a host list "localhost:4,node2:4": they
    # waited out the start timeout; found by helper-61)
    for loopback in ("127.0.0.1", "localhost"):
        with pytest.raises(GpucommError, match=r"a loopback address, but this job has ranks on other hosts"):
            bind_address(loopback, all_local=False)
    assert bind_address("127.0.0.1", all_local=False, override="127.0.0.1") == "127.0.0.1"
    assert bind_address("192.0.2.7", all_local=False, override="0.0.0.0") == "0.0.0.0"  # asked for explicitly
    with pytest.raises(GpucommError, match=rf"(?s)not an address of rank 0's host.*{BIND_VAR}"):
        bind_address("192.0.2.7", all_local=False)  # TEST-NET-1: never a local address


def test_the_address_for_peers_keeps_a_loopback_address_given_as_such():
    """127.0.0.1 or localhost given as the job's address is a launcher's choice for ranks of this machine (gpucomm-run's
    local store, elastic workers on the launcher's host): kept, also where no default route exists (helper-62). A
    name that resolves to loopback here is replaced (tests/test_multihost.py: torchrun across two hosts)."""
    from gpucomm.bootstrap.netaddr import address_for_peers

    assert address_for_peers("127.0.0.1") == "127.0.0.1"
    assert address_for_peers("127.0.0.2").startswith("127.")  # (the route to it leaves from 127.0.0.1)
    assert address_for_peers("localhost") == "127.0.0.1"


# ------------------------------------------------------------------------------------------------
# 3. one process per rank


def _check_duplicate(results: list[dict], rank: int, holder_pid: str, second_pid: str, second: dict) -> None:
    told = _line(second, "INIT-ERROR")
    assert f"{DUPLICATE} {rank} of this job" in told and f"pid {holder_pid} holds it" in told, told
    assert f"pid {second_pid} claimed it too, arriving at the rendezvous store" in told, told
    for res in results:
        failed = _line(res, "FAILED")
        assert f"{DUPLICATE} {rank}" in failed and f"pid {holder_pid}" in failed and f"pid {second_pid}" in failed, \
            failed


@pytest.mark.parametrize("rank", [1, 0])
def test_a_second_process_with_a_live_rank_fails_itself_and_the_job(tmp_path, rank):
    """Ranks 0 and 1 of a 2-rank job are up; then a second process with the same rank starts."""
    port, secret = free_port(), secrets.token_hex(32)
    procs = [_proc("hold", _horovod_env(r, 2, port, secret)) for r in range(2)]
    procs.append(_proc("hold", _horovod_env(rank, 2, port, secret), wave=1))
    results = _drive(tmp_path, procs)
    job, second = results[:2], results[2]
    assert second["code"] != 0, second
    holder_pid = _line(job[rank], "READY").split()[1]
    _check_duplicate(job, rank, holder_pid, _line(second, "PID"), second)


def test_an_impostor_claiming_a_live_rank_at_the_coordinator_fails_the_job(tmp_path):
    """A process holding the job secret connects to rank 0's control listener as rank 1."""
    port, secret = free_port(), secrets.token_hex(32)
    procs = [_proc("hold", _horovod_env(r, 3, port, secret)) for r in range(3)]
    procs.append(_proc("impostor", {"GPUCOMM_SECRET": secret, "GPUCOMM_RENDEZVOUS_PORT": str(port)}, wave=1,
                       unset=()))
    results = _drive(tmp_path, procs)
    job, impostor = results[:3], results[3]
    impostor_pid = _line(impostor, "IMPOSTOR").split()[0]
    rank1_pid = _line(job[1], "READY").split()[1]
    for res in job + [impostor]:
        text = _line(res, "FAILED" if res is not impostor else "TOLD")
        assert f"{DUPLICATE} 1 of this job" in text, text
        assert f"pid {rank1_pid} holds it" in text and f"pid {impostor_pid} from 127.0.0.1:" in text, text


SECRET = b"control-claims-secret-0123456789"


def _claim(port: int, rank: int, me: str, out: list) -> None:
    out.append(connect("127.0.0.1", port, SECRET, rank, 10, me=me))


@pytest.mark.parametrize("impostor_first", [True, False])
def test_a_control_claim_by_another_process_than_the_one_that_arrived_is_reported(impostor_first):
    """During accept: a claim whose (host, pid) is not the one that arrived at the store as that rank, or a
    second claim of a connected rank, is refused and reported naming both; the real rank is kept."""
    import os

    listener = ControlListener(SECRET, "127.0.0.1")
    conflicts: list[str] = []
    real: list = []
    fake: list = []
    order = [("fake", fake, "impostor-host"), ("real", real, "rank1-host")]
    if not impostor_first:
        order.reverse()
    claimants = {0: ("rank0-host", 1), 1: ("rank1-host", os.getpid()), 2: ("rank2-host", os.getpid())}

    def clients():
        for _, out, host in order:
            _claim(listener.port, 1, host, out)
        _claim(listener.port, 2, "rank2-host", [])

    t = threading.Thread(target=clients)
    t.start()
    try:
        chans = listener.accept([1, 2], 20, claimants=claimants, on_conflict=conflicts.append)
        t.join(20)
        assert sorted(chans) == [1, 2]
        assert len(conflicts) == 1, conflicts
        assert f"{DUPLICATE} 1 of this job: host rank1-host pid {os.getpid()} holds it" in conflicts[0]
        assert f"host impostor-host pid {os.getpid()} from 127.0.0.1:" in conflicts[0]
        late: list = []  # every rank is connected: any claim now is a second claimant
        _claim(listener.port, 2, "rank2-host", late)
        for _ in range(400):
            if len(conflicts) == 2:
                break
            time.sleep(0.05)
        assert len(conflicts) == 2, conflicts
        assert f"{DUPLICATE} 2 of this job" in conflicts[1] and "after every rank had connected" in conflicts[1]
        for chan in list(chans.values()) + real + fake + late:
            chan.sock.close()
    finally:
        listener.close()
        t.join(20)


def test_without_a_conflict_handler_a_second_claim_is_an_error():
    listener = ControlListener(SECRET, "127.0.0.1")
    out: list = []
    t = threading.Thread(target=lambda: [_claim(listener.port, 1, "h", out) for _ in range(2)])
    t.start()
    try:
        with pytest.raises(ControlError, match=rf"{DUPLICATE} 1 of this job: host h pid \d+ holds it"):
            listener.accept([1, 2], 20)
    finally:
        t.join(20)
        listener.close()
        for chan in out:
            chan.sock.close()


# ------------------------------------------------------------------------------------------------
# 5. bounded store memory


def test_the_store_caps_what_clients_store_and_hold_in_flight_and_says_why_it_refuses():
    r = run([PYTHON, PROGRAMS, "store-attack"], timeout=180, env={"GPUCOMM_STORE_MAX_BYTES": str(16 << 20)})
    assert r.returncode == 0 and r.leftovers == [], r.stdout + r.stderr
    report = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("STORE "))[len("STORE "):])
    print({k: v for k, v in report.items() if not isinstance(v, str)})
    # 3 MiB values: five fit under a 16 MiB cap, the sixth is refused with the cap and the knob named
    assert report["stored"] == 5, report
    assert re.search(r"refused to store 'big/5' \(3145728 bytes\).*over its cap of 16777216 bytes "
                     r"\(GPUCOMM_STORE_MAX_BYTES\)", report["value_refusal"]), report["value_refusal"]
    # a frame over the store's per-frame limit is refused with the reason, and the connection stays usable
    assert "refused a frame of 20971536 bytes: it takes at most 16777216 bytes per frame" in report["frame_refusal"]
    assert report["after_refusal"] == "1"
    # a value over the client's own frame limit never leaves: refused, not "rank 0 exited"
    assert report["huge_refusal"].startswith("RendezvousRefused: refused before sending"), report["huge_refusal"]
    assert "exited" not in report["huge_refusal"]
    # eight authenticated connections announcing 15 MiB frames: one fits the in-flight budget, the rest wait
    assert report["honest"] == "small"
    assert report["held_growth"] < 40 << 20, f"the store grew by {report['held_growth'] >> 20} MiB"


# ------------------------------------------------------------------------------------------------
# found on the way: after a re-init, a rank that reaches rank 0's previous store waits for the new one


def test_a_rank_that_reaches_the_previous_inits_store_waits_for_the_new_one():
    from gpucomm.bootstrap.arrival import open_store
    from gpucomm.bootstrap.rendezvous import RendezvousServer
    from gpucomm.bootstrap.world import detect_world

    secret = secrets.token_hex(32)
    port = free_port()
    world = detect_world(_horovod_env(1, 2, port, secret), hostname="rank1-host")
    old = RendezvousServer(bytes.fromhex(secret), "127.0.0.1", port)  # still serving the last ranks shutting down
    new: list = []

    def reinit_rank0() -> None:
        time.sleep(1.0)
        old.close()
        new.append(open_store(detect_world(_horovod_env(0, 2, port, secret), hostname="rank0-host"), 2, 30, 30,
                              prefix="/g2/")[0])

    t = threading.Thread(target=reinit_rank0)
    t.start()
    try:
        server, client = open_store(world, 2, 30, 30, prefix="/g2/")
        assert server is None
        client.set("/g2/arrive/1", b"here")
        t.join(30)
        assert new and new[0].snapshot("/g2/arrive/") == {"/g2/arrive/1": b"here"}  # landed in the new store
        client.close()
    finally:
        t.join(30)
        old.close()
        for s in new:
            s.close()
