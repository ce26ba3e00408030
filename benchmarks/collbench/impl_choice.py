"""Which implementations can run on this job's device, why the others cannot, and building the chosen
ones in a fixed order (each builds collectively: every rank, same order)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpucomm.backends.nccl import nccl_module

from .impl_base import IMPLS, Impl
from .impl_gpucomm import GpucommImpl
from .impl_nccl import NcclImpl
from .impl_torch import TorchImpl


def unavailable(name: str, device: str) -> str | None:
    """Why implementation ``name`` cannot run on ``device`` (None when it can)."""
    if name == "nccl":
        if device != "cuda":
            return "raw NCCL moves CUDA buffers only; use --device cuda (or leave nccl out on CPU)"
        if nccl_module() is None:
            return ("CuPy's NCCL bindings could not be loaded; install gpucomm's CUDA extra "
                    "(pip install 'gpucomm[cuda12]' or 'gpucomm[cuda13]')")
    if name == "torch":
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if device == "cuda" and not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
        if device == "cpu" and not dist.is_gloo_available():
            return "this torch build has no Gloo backend"
    return None


def not_measured(names: Sequence[str] | None, device: str) -> dict[str, str]:
    """The implementations left out of a default run (no --impls), each with the reason."""
    if names is not None:
        return {}
    reasons = {n: unavailable(n, device) for n in IMPLS}
    return {n: r for n, r in reasons.items() if r}


def make_impls(names: Sequence[str] | None, device: torch.device) -> list[Impl]:
    """Build the implementations in a fixed order (each builds collectively: every rank, same order)."""
    chosen = [n for n in IMPLS if (names is None and unavailable(n, device.type) is None) or (names and n in names)]
    impls: list[Impl] = []
    for name in chosen:
        if name == "gpucomm":
            impls.append(GpucommImpl())
        elif name == "torch":
            impls.append(TorchImpl(device))
        elif name == "nccl":
            impls.append(NcclImpl(nccl_module()))
    return impls
