"""Failure reports through the store: arrival order, what the launcher reads back, the excepthook."""

from __future__ import annotations

import textwrap

from gpucomm.failures import Failure, read_failures, record_failure, summarize
from gpucomm.bootstrap.rendezvous import RendezvousClient, RendezvousServer
from tests.harness import PYTHON, run


def test_reports_come_back_in_arrival_order():
    secret = b"s" * 32
    with RendezvousServer(secret, "127.0.0.1", 0) as server:
        client = RendezvousClient("127.0.0.1", server.port, secret, connect_timeout=10, timeout=10)
        try:
            record_failure(client, "job1", 3, "h3", "ValueError: first")
            record_failure(client, "job1", 0, "h0", "CollectiveError: echo")
            record_failure(client, "job2", 1, "h1", "other job")
        finally:
            client.close()
        assert read_failures(server.snapshot(), "job1") == [Failure(1, 3, "h3", "ValueError: first"),
                                                            Failure(2, 0, "h0", "CollectiveError: echo")]
        assert read_failures(server.snapshot("job2/"), "job2") == [Failure(1, 1, "h1", "other job")]
        assert read_failures(server.snapshot(), "nope") == []


def test_summary_is_one_bounded_line():
    assert summarize(ValueError("a\nb")) == "ValueError: a b"
    assert len(summarize(RuntimeError("x" * 2000))) == 500


def test_uncaught_exception_is_reported_and_still_printed():
    """A single-process job: init(), then an uncaught error; the hook reports it to the store (read
    back in the same process before exit through the excepthook chain) and the traceback prints."""
    code = textwrap.dedent("""
        import sys
        import gpucomm.torch as hvd
        from gpucomm import job as jobs
        from gpucomm.failures import read_failures
        hvd.init()
        rt = jobs.current()
        inner = sys.excepthook
        def check(*exc_info):
            inner(*exc_info)
            print("REPORTED", read_failures(rt.server.snapshot(), rt.world.run_id), flush=True)
        sys.excepthook = check
        raise KeyError("lost key")
    """)
    proc = run([PYTHON, "-c", code], timeout=120)
    assert proc.returncode == 1
    assert "KeyError: 'lost key'" in proc.stderr  # the traceback is still printed
    assert "REPORTED [Failure(order=1, rank=0, host=" in proc.stdout and "error=\"KeyError: 'lost key'\")]" in proc.stdout
