"""The per-byte host cost of one TCP stream, over loopback (issue 37, item 5).

    python benchmarks/tcp_host_cost.py [--seconds 1.5] [--repeats 3] [--json tcp_host_cost.json]

NCCL's socket transport moves every byte through the kernel's TCP stack on both hosts (its
``ptrSupport`` is ``NCCL_PTR_HOST``: data is staged in pinned host memory, then ``send``/``recv``
copy it into and out of socket buffers). With its defaults (``NCCL_SOCKET_NTHREADS`` 0,
``NCCL_NSOCKS_PERTHREAD`` 1, NCCL >= 2.5.6; one socket on the proxy thread before 2.4.8) one thread
does that work for a connection, so the CPU seconds each byte costs bound the connection's rate,
whatever the NIC's line rate.

Here one thread sends and one receives 1 MiB messages (NCCL's Simple steps are 512 KiB) over one
loopback TCP stream for ``--seconds``. Two numbers come out, the constants of
``gpucomm/tuning/transport.py``: the stream's wall-clock rate (``TCP_FLOW_GBS``: one flow with one
thread at each end, each on its own core here) and each thread's CPU time (``time.thread_time``)
over the bytes moved (``TCP_SEND_NS_PER_BYTE``, ``TCP_RECV_NS_PER_BYTE``; their sum is what one
thread pays to send a byte on and receive the next, as a proxy thread that holds both of a GPU's
network neighbours does). Loopback runs the receiver's protocol processing in the sender's call
and has no NIC or offloads, so these stand in for a real link's. Light: two threads for a few
seconds, medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stats import write_json  # noqa: E402

MESSAGE = 1 << 20


def one_run(seconds: float) -> dict[str, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    out: dict[str, float] = {}
    stop = threading.Event()

    def receive() -> None:
        conn, _ = listener.accept()
        buf = bytearray(MESSAGE)
        view = memoryview(buf)
        got, c0 = 0, time.thread_time()
        while True:
            n = conn.recv_into(view)
            if n == 0:
                break
            got += n
        out["recv_cpu_s"], out["recv_bytes"] = time.thread_time() - c0, got
        conn.close()

    rx = threading.Thread(target=receive)
    rx.start()
    tx = socket.create_connection(("127.0.0.1", port))
    data = memoryview(os.urandom(MESSAGE))
    sent, w0, c0 = 0, time.perf_counter(), time.thread_time()
    deadline = w0 + seconds
    while time.perf_counter() < deadline and not stop.is_set():
        tx.sendall(data)
        sent += MESSAGE
    out["send_cpu_s"], out["send_bytes"] = time.thread_time() - c0, sent
    tx.shutdown(socket.SHUT_WR)
    rx.join()
    out["wall_s"] = time.perf_counter() - w0
    tx.close()
    listener.close()
    return {"bytes": sent, "wall_s": out["wall_s"], "throughput_Bps": sent / out["wall_s"],
            "send_ns_per_byte": out["send_cpu_s"] / sent * 1e9,
            "recv_ns_per_byte": out["recv_cpu_s"] / out["recv_bytes"] * 1e9}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="tcp_host_cost.json")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1:
        ap.error("--seconds must be > 0 and --repeats >= 1")
    runs = [one_run(args.seconds) for _ in range(args.repeats)]
    for r in runs:
        r["both_ns_per_byte"] = r["send_ns_per_byte"] + r["recv_ns_per_byte"]
    med = {k: statistics.median(r[k] for r in runs) for k in ("throughput_Bps", "send_ns_per_byte",
                                                               "recv_ns_per_byte", "both_ns_per_byte")}
    both = med["both_ns_per_byte"]
    print(f"one loopback TCP stream, {MESSAGE >> 10} KiB messages, {args.repeats} x {args.seconds:g} s "
          f"({os.cpu_count()} CPUs):")
    for k, r in enumerate(runs):
        print(f"  run {k}: {r['throughput_Bps'] / 1e9:.2f} GB/s wall, send {r['send_ns_per_byte']:.3f} ns/B, "
              f"receive {r['recv_ns_per_byte']:.3f} ns/B of thread CPU")
    print(f"medians: one flow {med['throughput_Bps'] / 1e9:.2f} GB/s wall; send {med['send_ns_per_byte']:.3f}, receive "
          f"{med['recv_ns_per_byte']:.3f}, both {both:.3f} ns/B (median of each run's sum) -> one thread doing both: "
          f"{1 / both:.2f} GB/s")
    print("compare gpucomm.tuning.transport's TCP_FLOW_GBS, TCP_SEND_NS_PER_BYTE, TCP_RECV_NS_PER_BYTE")
    doc = {"benchmark": "tcp_host_cost", "message_bytes": MESSAGE, "cpus": os.cpu_count(), "runs": runs,
           "median": med, "send_plus_recv_ns_per_byte": both, "one_thread_both_Bps": 1e9 / both}
    write_json(args.json, doc)
    print(f"wrote {args.json}")
    return doc


if __name__ == "__main__":
    main()
