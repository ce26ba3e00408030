"""What the job ran on, for the "Using devices" lines and the JSON's ``env``: each rank's device, the
versions in play, the transport gpucomm's CPU collectives took and the counters its timed calls moved."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence
from typing import Any

import torch

import gpucomm
import gpucomm.torch as hvd
from gpucomm.backends.nccl import nccl_module, version_text

import anchors

from .impl_base import Impl
from .results import Table


def device_text(device: torch.device) -> str:
    """The device as a table header names it."""
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_record(device: torch.device) -> dict[str, Any]:
    """This rank's place, for the "Using devices" lines and the JSON."""
    rec: dict[str, Any] = {"rank": hvd.rank(), "pid": os.getpid(), "host": socket.gethostname()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        rec.update(device=f"{device.index}", bus_id=f"0x{bus:02x}" if isinstance(bus, int) else "?", name=props.name)
    else:
        rec.update(device="cpu", bus_id=f"{os.cpu_count()} cores", name=cpu_model())
    return rec


def environment(device: torch.device, impls: Sequence[Impl], devices: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranks, devices, versions (Python, torch, gpucomm, NCCL, CuPy) and the implementations' labels."""
    nccl = nccl_module()
    env: dict[str, Any] = {
        "ranks": hvd.size(), "device": device.type, "devices": devices, "python": platform.python_version(),
        "torch": torch.__version__, "gpucomm": gpucomm.__version__, "platform": platform.platform(),
        "implementations": {i.name: i.label for i in impls},
        "nccl": version_text(nccl.get_version()) if nccl is not None else None,
        "single_gpu_test": os.environ.get("GPUCOMM_SINGLE_GPU_TEST", "") not in ("", "0"),
    }
    try:
        import cupy  # noqa: PLC0415

        env["cupy"] = cupy.__version__
    except Exception:  # no CuPy, or one that cannot find CUDA: the CPU sweep does not need it
        env["cupy"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["torch_cuda"] = torch.version.cuda
        env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        env["device_name"] = cpu_model()
    return env


def cpu_transport(asked: str) -> dict[str, Any]:
    """What ``--cpu-operations`` asked for and the CPU collectives gpucomm ran on each transport
    (``hvd.stats()``: the proof of which one carried the sweep's data)."""
    counts = hvd.stats()
    return {"asked": asked, "collectives": {"gloo": counts["gloo_collectives"], "mpi": counts["mpi_collectives"]}}


def counter_record(tables: Sequence[Table]) -> dict[str, Any]:
    """gpucomm's counters (``hvd.stats()``) moved by the timed calls of its tables, summed, and the
    counters this gpucomm does not have (they read 0): which paths its calls took."""
    total: dict[str, int] = {}
    for t in tables:
        if t.impl == "gpucomm":
            anchors.add_counts(total, t.counters)
    have = hvd.stats()
    return {"timed_calls": total, "not_in_this_gpucomm": [c for c in anchors.COUNTERS if c not in have]}
