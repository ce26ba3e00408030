"""torch.distributed's default process group beside gpucomm in the same job (for benchmarks that
compare against DDP or raw torch collectives): rank 0 serves a TCPStore on a free port and shares
the port through gpucomm, so no fixed port and no extra launcher variables are needed."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

import gpucomm.torch as hvd


def init_torch_group(backend: str, timeout_s: float = 300.0) -> dist.TCPStore:
    """Initialize the default group (``gloo`` or ``nccl``) after ``hvd.init()``; keep the returned
    store alive for as long as the group is used."""
    store = dist.TCPStore("127.0.0.1", 0, hvd.size(), True, wait_for_workers=False) if hvd.rank() == 0 else None
    port = hvd.broadcast_object(store.port if store else None, 0, name="torch_group.port")
    if store is None:
        host = os.environ.get("GPUCOMM_RENDEZVOUS_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, port, hvd.size(), False)
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return store
