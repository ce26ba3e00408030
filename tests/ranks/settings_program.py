"""A rank for tests/test_settings.py, started as a real script: ``settings_program.py [NAME=VALUE]``
gives rank 0 alone (``GPUCOMM_RANK=0``, or a one-rank job) that setting, then joins the job and
says so on stdout."""

from __future__ import annotations

import os
import sys

if len(sys.argv) > 1 and os.environ.get("GPUCOMM_RANK", "0") == "0":
    name, _, value = sys.argv[1].partition("=")
    os.environ[name] = value

import gpucomm.torch as hvd  # noqa: E402 - after the setting is in place

hvd.init()
print(f"rank {hvd.rank()} of {hvd.size()}: init ok", flush=True)
hvd.shutdown()
