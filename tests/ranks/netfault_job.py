"""A rank of tests/test_netfaults.py and tests/test_multihost.py: allreduces in a loop until told
to stop, printing when it is steady and, on failure, the error with the time it was raised.

Environment: ``NETFAULT_ELEMENTS`` (floats per allreduce, default 1 Mi: well above the control
round's inline limit, so every allreduce runs on Gloo), ``NETFAULT_SECONDS`` (how long the loop
runs when nothing fails, by rank 0's clock: its last allreduce tells every rank to stop; default 600), ``NETFAULT_SLEEP`` (seconds between allreduces). Each rank
prints ``placed rank R/N local L/LS cross C/CS on HOST: TRANSPORT, NCCL_SOCKET_IFNAME=...`` after
``init()``, ``steady rank R on HOST`` after its 5th allreduce; a rank whose collective fails prints
``FAULT rank R on HOST at T: <error>`` on stderr (T: ``time.time()``; every host of a namespace cluster
shares the clock) and raises it again, as a training script would (it exits 1). ``sockets rank R: ...`` lists the addresses this process listens on
and is connected to (for the NIC tests). With ``NETFAULT_OUT`` set, each rank also writes its end
to ``NETFAULT_OUT/rank<R>.json`` (a cut host's output cannot reach the launcher), and its threads'
stacks to ``NETFAULT_OUT/stacks<R>.txt`` on SIGUSR1. ``NETFAULT_PROCESS_SET=0,2`` registers that process set
at ``init()``, and its ranks allreduce ``NETFAULT_ELEMENTS`` floats on it once (on a Gloo group of its own)
before the loop, printing ``process set rank R sum S``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch

import gpucomm.torch as hvd


def sockets() -> dict[str, list[str]]:
    """Where this process's TCP sockets listen and which peers they are connected to. A connection to
    torchrun's own store (MASTER_PORT; torch's socket, to the address torchrun chose) is listed apart,
    under ``torch_store``: the NIC tests are about gpucomm's store, control plane and Gloo."""
    listening, peers, local, torch_store = set(), set(), set(), set()
    master_port = int(os.environ.get("MASTER_PORT") or 0) if os.environ.get("TORCHELASTIC_RUN_ID") else 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN:
            listening.add(c.laddr.ip)
        elif c.raddr and master_port and c.raddr.port == master_port:
            torch_store.add(f"{c.laddr.ip} -> {c.raddr.ip}")
        elif c.raddr:
            peers.add(c.raddr.ip)
            local.add(c.laddr.ip)
    return {"listen": sorted(listening), "local": sorted(local), "peers": sorted(peers),
            "torch_store": sorted(torch_store)}


def record(rank: int, host: str, outcome: str) -> None:
    """Write this rank's end to ``NETFAULT_OUT`` (when set)."""
    out = os.environ.get("NETFAULT_OUT")
    if out:
        end = {"rank": rank, "host": host, "time": time.time(), "outcome": outcome}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(end))


def main() -> None:
    out = os.environ.get("NETFAULT_OUT")
    members = [int(r) for r in os.environ.get("NETFAULT_PROCESS_SET", "").split(",") if r]
    process_set = hvd.ProcessSet(members) if members else None
    hvd.init(process_sets=[process_set] if process_set is not None else None)
    host = os.environ.get("GPUCOMM_HOSTNAME") or os.uname().nodename
    print(f"placed rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} cross "
          f"{hvd.cross_rank()}/{hvd.cross_size()} on {host}: {'mpi' if hvd.mpi_enabled() else 'gloo'}, "
          f"NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME', '')}", flush=True)
    if out:
        stacks = open(Path(out) / f"stacks{hvd.rank()}.txt", "w")  # noqa: SIM115 - the handler writes to it
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    elements = int(os.environ.get("NETFAULT_ELEMENTS", str(1 << 20)))
    seconds = float(os.environ.get("NETFAULT_SECONDS", "600"))
    pause = float(os.environ.get("NETFAULT_SLEEP", "0"))
    x = torch.ones(elements)
    if process_set is not None and hvd.rank() in members:
        total = hvd.allreduce(x * (hvd.rank() + 1), op=hvd.Sum, process_set=process_set)
        print(f"process set rank {hvd.rank()} sum {total[0].item():g}", flush=True)
    end = time.monotonic() + seconds
    step, slowest = 0, 0.0
    try:
        while True:
            began = time.monotonic()
            x[1] = float(hvd.rank() == 0 and time.monotonic() >= end)  # rank 0's clock ends the loop everywhere
            total = hvd.allreduce(x, name="netfault", op=hvd.Sum)
            slowest = max(slowest, time.monotonic() - began)
            if total[0].item() != hvd.size():
                raise SystemExit(f"rank {hvd.rank()}: allreduce gave {total[0].item()}, expected {hvd.size()}")
            if total[1].item() > 0:
                break
            step += 1
            if step == 5:
                print(f"steady rank {hvd.rank()} on {host}", flush=True)
                print(f"sockets rank {hvd.rank()}: {json.dumps(sockets())}", flush=True)
            time.sleep(pause)
    except Exception as e:  # noqa: BLE001 - the error is the result: printed with its time
        record(hvd.rank(), host, f"{type(e).__name__}: {e}")
        print(f"FAULT rank {hvd.rank()} on {host} at {time.time():.3f}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise  # as a training script would: gpucomm reports it to the launcher, the rank exits 1
    record(hvd.rank(), host, f"done: {step} allreduces, the slowest took {slowest:.2f} s")
    print(f"done rank {hvd.rank()} after {step} allreduces, the slowest took {slowest:.2f} s", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
