"""The teardown of an elastic survivor, reduced to two ranks and one Gloo group (issue 36, finding 8).

Rank 0 is a survivor of a failed round: a collective of that round is still pending on its Gloo group
(rank 1 never joins it), rank 0 gives up waiting (``GlooWork.wait``'s ``failed``), and closes the group as
the job's close does after a failure (``close(abort=True)``). Rank 1 is a worker that leaves the job
normally: it exits with status 0, but only once rank 0's interpreter is finalizing (rank 0 tells it so
from a ``__del__`` that runs while ``__main__`` is torn down, then sleeps with the GIL released). Its exit
closes its side of the old round's pair.

Before the fix the pending work failed right then, on a Gloo thread, and that thread needed the GIL
(to release the Python done-callback ``GlooWork.wait`` had attached to the work's future) from an
interpreter that was finalizing: Python ended the thread with ``pthread_exit`` in the middle of a C++
destructor, and the rank died of SIGABRT (``terminate called after throwing an instance of
'gloo::IoException' ... Connection closed by peer``) after its work was done. The closed group must
end its pending work while the interpreter is alive, so both ranks exit 0.

``python tests/ranks/elastic_teardown.py SIGNAL_FILE [wait|callback]`` as both ranks of a 2-rank job (the
test harness gives the environment). ``wait``: rank 0 waits as gpucomm's handles do; ``callback``: it also
puts a Python done-callback on the work's future itself, as the timeline does (only the group's abort can
make that one safe).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from gpucomm.backends.base import BackendOp
from gpucomm.backends.gloo import GlooDevice, gloo_group
from gpucomm.bootstrap.rendezvous import RendezvousClient
from gpucomm.errors import CollectiveError

GLOO_TIMEOUT_S = 60.0  # the pending work must not end by Gloo's own timeout during the test
GIVE_UP_S = 0.3  # rank 0 stops waiting for the pending work after this long
EXIT_WAIT_S = 30.0  # rank 1 waits at most this long for rank 0's signal


class _TellPeerAtFinalization:
    """Kept in ``__main__``'s globals: its ``__del__`` runs while the interpreter finalizes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self, _open=os.open, _close=os.close, _sleep=time.sleep, _flags=os.O_CREAT | os.O_WRONLY) -> None:
        _close(_open(self.path, _flags, 0o600))  # rank 1 exits now: its side of the old round's pair closes
        _sleep(1.5)  # GIL released, interpreter finalizing: a Gloo thread that needs Python now is killed


def survivor(client: RendezvousClient, signal_file: str, mode: str) -> None:
    group = gloo_group(client, "teardown/", 0, 2, timeout=GLOO_TIMEOUT_S, device=GlooDevice(hostname="127.0.0.1"))
    warm = torch.ones(4)
    group.allreduce(warm, warm, op=BackendOp.SUM).wait(GLOO_TIMEOUT_S)
    pending = torch.ones(4)
    work = group.allreduce(pending, pending, op=BackendOp.SUM)  # rank 1 never joins it: the round failed
    called = []
    if mode == "callback":
        # a bound builtin: a Python function would keep __main__'s globals (and the hook below) alive forever
        work.future().add_done_callback(called.append)
    t0 = time.monotonic()
    try:
        work.wait(GLOO_TIMEOUT_S, failed=lambda: time.monotonic() - t0 > GIVE_UP_S)
        raise AssertionError("the pending allreduce completed although rank 1 never joined it")
    except CollectiveError:
        pass
    group.close(abort=True)
    client.set("teardown/closed", b"1")
    print(f"rank 0: closed the failed round's group (pending work done: {work.done()}, callback ran: {bool(called)});"
          f" exiting", flush=True)
    globals()["_tell_peer"] = _TellPeerAtFinalization(signal_file)


def leaver(client: RendezvousClient, signal_file: str, _mode: str) -> None:
    group = gloo_group(client, "teardown/", 1, 2, timeout=GLOO_TIMEOUT_S, device=GlooDevice(hostname="127.0.0.1"))
    warm = torch.ones(4)
    group.allreduce(warm, warm, op=BackendOp.SUM).wait(GLOO_TIMEOUT_S)
    client.wait(["teardown/closed"], EXIT_WAIT_S)
    deadline = time.monotonic() + EXIT_WAIT_S
    while not os.path.exists(signal_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("rank 1: leaving the job normally", flush=True)
    os._exit(0)  # exits at once (its own teardown is not what is tested): the pair closes now


def main() -> None:
    rank = int(os.environ["GPUCOMM_RANK"])
    client = RendezvousClient(os.environ["GPUCOMM_RENDEZVOUS_ADDR"], int(os.environ["GPUCOMM_RENDEZVOUS_PORT"]),
                              bytes.fromhex(os.environ["GPUCOMM_SECRET"]))
    (survivor if rank == 0 else leaver)(client, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "wait")


if __name__ == "__main__":
    main()
