"""Programs for tests/test_trust_edges.py, run as real processes.

``python tests/ranks/trust_programs.py driver SPEC`` starts the processes SPEC (a JSON file) lists, in
waves: a wave starts once every process of the previous one has printed ``READY`` (or exited).
Each process runs ``python tests/ranks/trust_programs.py ROLE`` with its own environment. When all have
exited (or the driver's deadline passed: the rest are killed), it prints one JSON line
``RESULTS [...]`` with each process's exit code, stdout and stderr. The test runs the driver
through ``tests.harness.run``, which reaps the whole session.

Roles:
- ``twice``: init, allreduce, shutdown, twice over; prints ``OK <rank>``.
- ``hold``: init (``INIT-ERROR <message>`` if it raises), print ``READY <rank> <pid>``, then
  allreduce until a collective fails: ``FAILED <message>`` (or ``NO-FAILURE`` after 60 s).
- ``listening``: init, print ``LISTENING <ip>`` for the rendezvous port, allreduce, shutdown.
- ``impostor``: holds the job secret; reads rank 0's control address from the store, claims rank 1
  there under its own pid, and prints what rank 0 answered (``TOLD <message>``).

``python tests/ranks/trust_programs.py store-attack`` starts a store (``store-server``, a child process
whose memory it reads, with ``GPUCOMM_STORE_MAX_BYTES`` from its own environment) and attacks it as
an authenticated client; it prints ``STORE {json}`` with what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD_SECONDS = 60.0


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def twice() -> None:
    import torch

    import gpucomm.torch as hvd

    for _ in range(2):
        hvd.init()
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(hvd.size())] * 2
        hvd.shutdown()
    print(f"OK {os.environ.get('HOROVOD_RANK', os.environ.get('GPUCOMM_RANK'))}", flush=True)


def hold() -> None:
    import torch

    import gpucomm.torch as hvd

    print(f"PID {os.getpid()}", flush=True)
    try:
        hvd.init()
    except Exception as e:  # noqa: BLE001 - the message is the point
        print(f"INIT-ERROR {_one_line(e)}", flush=True)
        raise SystemExit(3)
    from gpucomm import job as jobs

    job = jobs.current()
    if hvd.rank() == 0:  # tell an impostor where the coordinator listens (it could read the store itself)
        job.client.set("trust-test/control", job.client.get(job.prefix + "control"))
    print(f"READY {hvd.rank()} {os.getpid()}", flush=True)
    deadline = time.monotonic() + HOLD_SECONDS
    try:
        while time.monotonic() < deadline:
            hvd.allreduce(torch.ones(1), name="hold")
            time.sleep(0.05)
        print("NO-FAILURE", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"FAILED {_one_line(e)}", flush=True)
    try:
        hvd.shutdown()
    except Exception:  # noqa: BLE001 - a failed job may refuse a clean shutdown; the output above is the result
        pass


def listening() -> None:
    import psutil
    import torch

    import gpucomm.torch as hvd

    hvd.init()
    port = int(os.environ["GPUCOMM_RENDEZVOUS_PORT"])
    if hvd.rank() == 0:
        bound = {c.laddr.ip for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        print(f"LISTENING {' '.join(sorted(bound))}", flush=True)
    hvd.allreduce(torch.ones(1))
    hvd.shutdown()


def impostor() -> None:
    from gpucomm.bootstrap.rendezvous import RendezvousClient
    from gpucomm.control import channel

    secret = bytes.fromhex(os.environ["GPUCOMM_SECRET"])
    store = RendezvousClient("127.0.0.1", int(os.environ["GPUCOMM_RENDEZVOUS_PORT"]), secret, connect_timeout=30)
    where = json.loads(store.get("trust-test/control", 30))
    print(f"IMPOSTOR {os.getpid()} claims rank 1 at {where['host']}:{where['port']}", flush=True)
    chan = channel.connect(where["host"], where["port"], secret, 1, 30)
    chan.sock.settimeout(30)
    try:
        told = channel.recv(chan)
        print(f"TOLD {_one_line(told)}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"NOT-TOLD {type(e).__name__}: {e}", flush=True)


SECRET = b"trust-test-secret-0123456789abcdef"
MIB = 1 << 20


def store_server() -> None:
    from gpucomm.bootstrap.rendezvous import RendezvousServer

    server = RendezvousServer(SECRET, "127.0.0.1", 0)
    print(server.port, flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin


def store_attack() -> None:
    import socket
    import struct

    import psutil

    from gpucomm.bootstrap.framing import HELLO_BYTES, MAC_BYTES, FramedChannel, decode_fields, encode_fields
    from gpucomm.bootstrap import rendezvous
    from gpucomm.bootstrap.rendezvous import OP_PING, RendezvousClient

    refused = getattr(rendezvous, "RendezvousRefused", rendezvous.RendezvousError)  # so that older code reports too

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "store-server"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    report: dict = {}
    try:
        port = int(proc.stdout.readline())
        server = psutil.Process(proc.pid)
        client = RendezvousClient("127.0.0.1", port, SECRET, connect_timeout=30, timeout=60)
        rss0 = server.memory_info().rss
        # values under different keys, 3 MiB each, until the cap refuses one
        value = b"v" * (3 * MIB)
        stored, refusal = 0, None
        for i in range(8):
            try:
                client.set(f"big/{i}", value)
                stored += 1
            except refused as e:
                refusal = str(e)
                break
        report.update(stored=stored, value_refusal=refusal, values_growth=server.memory_info().rss - rss0)
        # a frame over the store's frame limit (the client's own limit is the default 64 MiB)
        try:
            client.set("too-big", b"x" * (20 * MIB))
            report["frame_refusal"] = None
        except refused as e:
            report["frame_refusal"] = str(e)
        client.set("after-refusal", b"1")  # the connection is still in step
        report["after_refusal"] = client.get("after-refusal").decode()
        try:
            client.set("huge", b"x" * (100 * MIB))
            report["huge_refusal"] = None
        except Exception as e:  # noqa: BLE001 - any error: the message is checked
            report["huge_refusal"] = f"{type(e).__name__}: {e}"
        # authenticated connections that announce 15 MiB frames and never send them
        rss1 = server.memory_info().rss
        holders = []
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            hello = sock.recv(HELLO_BYTES, socket.MSG_WAITALL)
            chan = FramedChannel(sock, SECRET, hello[5:], b"C", 1 << 30)
            chan.send(encode_fields(OP_PING, []))
            assert decode_fields(chan.recv(None))[0] == 0
            sock.sendall(struct.pack(">I", MAC_BYTES + 15 * MIB))
            holders.append(sock)
        time.sleep(1.0)
        client.set("honest", b"small")  # small frames need no room in the in-flight budget
        report["honest"] = client.get("honest").decode()
        report["held_growth"] = server.memory_info().rss - rss1
        for sock in holders:
            sock.close()
        client.close()
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    print("STORE " + json.dumps(report), flush=True)


def driver(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    deadline = time.monotonic() + spec.get("timeout", 120)
    waves: dict[int, list[int]] = {}
    for i, p in enumerate(spec["procs"]):
        waves.setdefault(p.get("wave", 0), []).append(i)
    procs: dict[int, subprocess.Popen] = {}
    out: dict[int, list[str]] = {}
    err: dict[int, list[str]] = {}
    readers = []
    for wave in sorted(waves):
        while wave and time.monotonic() < deadline and not all(
                any(line.startswith("READY") for line in out[i]) or procs[i].poll() is not None for i in procs):
            time.sleep(0.02)  # the previous waves are not ready yet
        for i in waves[wave]:
            p = spec["procs"][i]
            env = dict(os.environ, PYTHONPATH=ROOT)
            for name in p.get("unset", []):
                env.pop(name, None)
            env.update(p["env"])
            procs[i] = subprocess.Popen([sys.executable, os.path.abspath(__file__), p["role"]], env=env, cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out[i], err[i] = [], []
            for stream, lines in ((procs[i].stdout, out[i]), (procs[i].stderr, err[i])):
                reader = threading.Thread(target=_collect, args=(stream, lines), daemon=True)
                reader.start()
                readers.append(reader)
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    results = [{"code": procs[i].returncode, "stdout": "".join(out[i]), "stderr": "".join(err[i])}
               for i in sorted(procs)]
    print("RESULTS " + json.dumps(results), flush=True)


def _collect(stream, lines: list[str]) -> None:
    for line in iter(stream.readline, ""):
        lines.append(line)


if __name__ == "__main__":
    if sys.argv[1] == "driver":
        driver(sys.argv[2])
    else:
        {"twice": twice, "hold": hold, "listening": listening, "impostor": impostor, "store-server": store_server,
         "store-attack": store_attack}[sys.argv[1]]()
