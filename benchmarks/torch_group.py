"""torch.distributed's default process group beside gpucomm in the same job (for benchmarks that
compare against DDP or raw torch collectives): rank 0 serves a TCPStore on a free port and shares
the port through gpucomm, so no fixed port and no extra launcher variables are needed."""

from __future__ import annotations

import datetime
import os

import torch
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


# all_gather_single / reduce_scatter_single replace the *_tensor names (deprecated, with a FutureWarning) in recent torch
FLAT_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
FLAT_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gloo_collectives(group=None) -> dict[str, bool]:
    """Which flat collectives this torch's Gloo has (torch 2.1's has neither ``all_gather_into_tensor`` nor
    ``reduce_scatter_tensor``): each is tried once, at the same point on every rank of ``group`` (it fails
    before anything is sent, alike everywhere). An anchor without the first gathers into views of its output
    (``all_gather_into``), as a user of that torch writes it; one without the second has no reduce-scatter."""
    p = dist.get_world_size(group)
    has = {}
    for kind, call in (("allgather", lambda: FLAT_GATHER(torch.zeros(p), torch.zeros(1), group=group)),
                       ("reducescatter", lambda: FLAT_SCATTER(torch.zeros(1), torch.zeros(p), group=group))):
        try:
            call()
            has[kind] = True
        except RuntimeError as e:  # "no support for _allgather_base", "does not support _reduce_scatter_base"
            if "_base" not in str(e):
                raise
            has[kind] = False
    return has


def all_gather_into(out: torch.Tensor, x: torch.Tensor, flat: bool, group=None) -> None:
    """``all_gather_into_tensor(out, x)``, or (``flat`` False: a Gloo without it) ``all_gather`` into the equal
    views of ``out``, one per rank."""
    if flat:
        FLAT_GATHER(out, x, group=group)
    else:
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), x, group=group)
