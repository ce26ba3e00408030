"""``save_checkpoint``: written atomically, and the temporaries of writers killed mid-write are swept."""

from __future__ import annotations

import signal
import textwrap
import time

import torch

from tests.harness import PYTHON, started


def test_save_checkpoint_sweeps_temporaries_of_killed_writers(tmp_path):
    """Writers SIGKILLed mid-write leave their temporary files; the next save removes them (and only them)."""
    target = tmp_path / "ckpt.pt"
    writer = textwrap.dedent(f"""
        import torch
        from gpucomm.torch.checkpoint import save_checkpoint
        print("writing", flush=True)
        save_checkpoint({{"w": torch.zeros(64 << 20, dtype=torch.uint8)}}, {str(target)!r})
    """)
    for _ in range(3):
        with started([PYTHON, "-c", writer], stderr=None, timeout=120) as w:
            assert w.proc.stdout.readline().strip() == "writing"
            deadline = time.monotonic() + 60
            while not list(tmp_path.glob(".ckpt.pt.*.tmp")) and time.monotonic() < deadline:
                time.sleep(0.005)
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(timeout=30)
    left = sorted(tmp_path.glob(".ckpt.pt.*.tmp"))
    assert left, "the killed writers left nothing to sweep (they finished first)"
    foreign = tmp_path / ".ckpt.pt.other-host.1.abc.tmp"  # another host's writer, sharing the directory
    foreign.write_bytes(b"x")
    from gpucomm.torch.checkpoint import save_checkpoint

    assert save_checkpoint({"v": 1}, target)
    assert sorted(tmp_path.glob(".ckpt.pt.*.tmp")) == [foreign]
    assert torch.load(target) == {"v": 1}
