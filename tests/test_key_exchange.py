"""The job secret never reaches torchrun's unauthenticated store, and stores bind one interface."""

from __future__ import annotations

import datetime
import json
import textwrap
import threading
import time

import pytest

from gpucomm.bootstrap.arrival import torch_store_rendezvous
from gpucomm.bootstrap.key_exchange import KeyPair, SealError, seal, unseal
from gpucomm.bootstrap.placement import Placement
from gpucomm.bootstrap.world import World
from gpucomm.backends.base import torch_at_least
from gpucomm.errors import GpucommError
from tests.harness import PYTHON, ROOT, free_port, launcher_cmd, run, write_script
from tests.test_launchers import _torchrun


def test_sealed_secret_opens_only_under_the_pair_key():
    rank0, rank1, intruder = KeyPair(), KeyPair(), KeyPair()
    secret = bytes(range(32))
    sealed = seal(secret, rank0.shared_key(rank1.public_hex(), b"job/rank1"))
    assert secret.hex() not in sealed
    assert unseal(sealed, rank1.shared_key(rank0.public_hex(), b"job/rank1")) == secret
    for wrong in (intruder.shared_key(rank0.public_hex(), b"job/rank1"),
                  rank1.shared_key(rank0.public_hex(), b"job/rank2")):
        with pytest.raises(SealError):
            unseal(sealed, wrong)
    with pytest.raises(SealError, match="out of range"):
        rank1.shared_key("1", b"x")


SNOOP = textwrap.dedent("""
    import datetime, os
    import psutil
    import torch
    import torch.distributed as dist
    import gpucomm.torch as hvd
    from gpucomm import job as jobs

    hvd.init()
    secret = jobs.current().client.secret
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if hvd.rank() == 1 and not agent_store:
        print("NO AGENT STORE", flush=True)
    if hvd.rank() == 1 and agent_store:  # read every key gpucomm wrote into torchrun's store, as any local process could
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        prefix = f"gpucomm/{os.environ['TORCHELASTIC_RUN_ID']}/r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        base = next(f"{prefix}/g{g}" for g in range(8) if store.check([f"{prefix}/g{g}/rendezvous"]))
        keys = [f"{base}/rendezvous", f"{base}/public/1", f"{base}/sealed/1"]
        values = [store.get(k) for k in keys if store.check([k])]
        assert len(values) == 3, keys
        assert not any(secret.hex().encode() in v or secret in v for v in values), "the secret is in torchrun's store"
        print("SNOOPED", len(values), "keys; no secret", flush=True)
    if hvd.rank() == 0:
        bound = {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert "0.0.0.0" not in bound and "::" not in bound, bound
        print("LISTENING ON", sorted(bound), flush=True)
    hvd.allreduce(torch.ones(1))
    hvd.shutdown()
""")


def test_torchrun_store_never_holds_the_secret_and_rank0_binds_one_address(tmp_path):
    script = write_script(tmp_path, "snoop.py", SNOOP)
    r = run(_torchrun() + ["--standalone", "--nproc-per-node", "2", str(script)], timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LISTENING ON" in r.stdout and r.leftovers == [], r.stdout
    if "NO AGENT STORE" in r.stdout:
        assert not torch_at_least(2, 13), r.stdout  # the torchruns CI runs the suite with keep a store of their own
        pytest.skip("this torch's torchrun (2.1) keeps no store of its own: rank 0 serves it and closes it once every "
                    "rank has read the rendezvous, so nothing is left to snoop afterwards")
    assert "SNOOPED 3 keys; no secret" in r.stdout, r.stdout


def test_launcher_store_binds_the_interface_it_was_given(tmp_path):
    script = write_script(tmp_path, "where.py", textwrap.dedent("""
        import os, psutil
        launcher = psutil.Process(os.getppid())
        bound = {c.laddr.ip for c in launcher.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        print("LAUNCHER LISTENS ON", sorted(bound), flush=True)
        assert bound == {"127.0.0.1"}, bound
    """))
    r = run(launcher_cmd("-np", "1", "--network-interface", "lo", PYTHON, str(script)), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LAUNCHER LISTENS ON ['127.0.0.1']" in r.stdout


def test_a_secret_on_some_ranks_only_is_an_error_not_a_hang(tmp_path):
    script = write_script(tmp_path, "half.py", textwrap.dedent("""
        import os
        if os.environ["RANK"] == "1":
            os.environ["GPUCOMM_SECRET"] = "ab" * 32
        import gpucomm.torch as hvd
        try:
            hvd.init()
        except Exception as e:
            print(f"RANK {os.environ['RANK']} ERROR {e}", flush=True)
            raise SystemExit(3)
    """))
    r = run(_torchrun() + ["--standalone", "--nproc-per-node", "2", str(script)], timeout=180, cwd=ROOT,
            env={"GPUCOMM_START_TIMEOUT": "120"})
    assert "RANK 1 ERROR rank 1 has GPUCOMM_SECRET set and rank 0 does not" in r.stdout, r.stdout + r.stderr
    assert "RANK 0 ERROR rank 1 has GPUCOMM_SECRET set and rank 0 does not" in r.stdout, r.stdout + r.stderr
    assert r.leftovers == []


def test_rank0_serving_torchruns_store_keeps_it_until_the_others_have_read_the_mismatch(monkeypatch):
    """torch 2.1's torchrun leaves its store to rank 0's process. Rank 0, finding a secret on rank 1 only, must
    keep serving the store until rank 1 has read why; it used to raise at once, and rank 1, whose read raced the
    store's end, failed with "Connection reset by peer" instead (seen in CI)."""
    import torch.distributed as dist

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    port = free_port()
    rank0 = World(Placement("here", 0, 2, 0, 2, 0, 1), "torchrun", "127.0.0.1", port, False, True, None, "random",
                  "job")
    raised: list[BaseException] = []

    def serve():
        try:
            torch_store_rendezvous(rank0, 0, 30.0)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    base = "gpucomm/job/r0/g0"
    store.set(f"{base}/public/1", "env")  # what a rank with GPUCOMM_SECRET set publishes instead of a key
    store.wait([f"{base}/rendezvous"], datetime.timedelta(seconds=30))
    thread.join(1.0)
    assert thread.is_alive() and not raised, raised  # still serving: rank 1 has not read the rendezvous yet
    assert json.loads(store.get(f"{base}/rendezvous")) == {"error": "rank 1 has GPUCOMM_SECRET set"}
    store.set(f"{base}/read/1", "1")
    thread.join(30.0)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], GpucommError), raised
    assert "rank 1 has GPUCOMM_SECRET set and rank 0 does not" in str(raised[0])


def test_a_rank_that_cannot_read_torchruns_store_says_why(monkeypatch):
    """Rank 0 never publishes (it failed, or never started): rank 1's read ends after the start timeout with an
    error that names the store and where rank 0's own error is, not torch's bare store error."""
    import torch.distributed as dist

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    port = free_port()
    served = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    rank1 = World(Placement("here", 1, 2, 1, 2, 0, 1), "torchrun", "127.0.0.1", port, False, True, None, "random",
                  "job")
    with pytest.raises(GpucommError, match="rank 1 could not read the job's rendezvous from torchrun's store") as e:
        torch_store_rendezvous(rank1, 0, 1.0)
    assert "GPUCOMM_START_TIMEOUT" in str(e.value) and "--tee 3" in str(e.value)
    del served


class _Stranger:
    """Another process's listener on a port: accepts each connection and closes it at once, as a
    server of another protocol would, until ``release()``."""

    def __init__(self, port: int):
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def release(self):
        self._stop.set()
        self._thread.join(5.0)
        self.sock.close()


def _torchrun_world(rank: int, port: int) -> World:
    return World(Placement("here", rank, 2, rank, 2, 0, 1), "torchrun", "127.0.0.1", port, False, True, None,
                 "random", "job")


def test_rank0_waits_for_torchruns_port_that_another_process_took(monkeypatch):
    """torch < 2.4's torchrun picks MASTER_PORT free, closes it and leaves it to rank 0, so another process can bind
    it first (seen in CI: a neighbouring test's server took it, rank 0 failed on "Address already in use" and rank 1,
    connected to that stranger, on "Connection reset by peer"). Rank 0 now waits for the port and rank 1 retries,
    within the start timeout, and the job meets once the stranger lets go."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    port = free_port()
    stranger = _Stranger(port)
    results: dict[int, object] = {}

    def meet(rank):
        try:
            results[rank] = torch_store_rendezvous(_torchrun_world(rank, port), 0, 60.0)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            results[rank] = e

    threads = [threading.Thread(target=meet, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while stranger.accepted == 0 and time.monotonic() < deadline:  # rank 1 has found the stranger
        time.sleep(0.05)
    time.sleep(1.0)
    assert not results, results  # both still trying, not failed
    stranger.release()
    for t in threads:
        t.join(60.0)
    assert stranger.accepted >= 1
    assert not isinstance(results[0], BaseException), results[0]
    assert not isinstance(results[1], BaseException), results[1]
    server, host, port0, secret0 = results[0]
    _, host1, port1, secret1 = results[1]
    try:
        assert (host1, port1, secret1) == (host, port0, secret0)
    finally:
        server.close()


def test_rank0_names_the_race_when_torchruns_port_stays_taken(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    port = free_port()
    stranger = _Stranger(port)
    try:
        with pytest.raises(GpucommError, match=f"another process held port {port} for the whole 1 s") as e:
            torch_store_rendezvous(_torchrun_world(0, port), 0, 1.0)
    finally:
        stranger.release()
    assert "torch >= 2.4" in str(e.value) and "--master-port" in str(e.value)
