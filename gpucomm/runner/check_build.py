"""``gpucomm-run --check-build``: what this installation can do, probed for real (each line says why
a capability is missing), like ``horovodrun --check-build``."""

from __future__ import annotations

import shutil
from typing import Callable

from .. import __version__
from ..source_digest import source_digest


def _probe(fn: Callable[[], str]) -> tuple[bool, str]:
    try:
        return True, fn()
    except Exception as e:  # each probe reports its own failure as text
        text = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        return False, text.strip()


def _torch() -> str:
    import torch

    return f"PyTorch {torch.__version__}"


def _gloo() -> str:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("this torch build has no Gloo (torch.distributed.is_gloo_available() is False)")
    return "Gloo (torch.distributed ProcessGroupGloo): CPU tensors"


def _nccl() -> str:
    import cupy

    from ..backends.nccl import nccl_module, nccl_version, version_text

    if nccl_module() is None:
        raise RuntimeError(f"CuPy {cupy.__version__} is installed but its NCCL bindings did not load; install "
                           f"nvidia-nccl-cu12/cu13 matching CuPy's CUDA")
    return f"NCCL {version_text(nccl_version())} through CuPy {cupy.__version__}: CUDA tensors"


def _gpus() -> str:
    from ..bootstrap import devices

    gpus = devices.nvml_gpus()
    if not gpus:
        raise RuntimeError("NVML sees no GPU (no NVIDIA driver, or no GPU on this host): ranks use the CPU path")
    return f"{len(gpus)} GPU(s) seen by NVML: " + "; ".join(f"{g.name} at {g.pci_bus_id}" for g in gpus)


def _numba_cuda() -> str:
    import numba
    from numba import cuda

    from importlib.metadata import version

    try:
        nc = f"numba-cuda {version('numba-cuda')}"
    except Exception:
        nc = "numba-cuda (version unknown)"
    from ..kernels import KERNELS, launch  # noqa: PLC0415

    launch.compile_ptx(KERNELS["scale_f32"], (9, 0))  # raises with the cause if this stack cannot build kernels
    from ..kernels import compat  # noqa: PLC0415

    shims = compat.applied_shims()
    shimmed = f"; NumPy names restored for numba-cuda: {', '.join(shims)}" if shims else ""
    where = "GPU available" if cuda.is_available() else "no usable GPU: kernels compile but cannot run here"
    return f"Numba {numba.__version__}, {nc}: a kernel compiles to PTX{shimmed}; {where}"


def _mpirun() -> str:
    path = shutil.which("mpirun") or shutil.which("mpiexec")
    if path is None:
        raise RuntimeError("no mpirun/mpiexec on PATH (optional: gpucomm only needs it to run under MPI)")
    return f"mpirun at {path}"


def _ssh() -> str:
    path = shutil.which("ssh")
    if path is None:
        raise RuntimeError("no ssh client on PATH: only local ranks can be started")
    return f"ssh client at {path}: remote hosts in -H / --hostfile"


def check_build_report() -> str:
    """The ``--check-build`` text: one ``[X]`` / ``[ ]`` line per capability."""
    sections = [
        ("Frameworks", [_torch]),
        ("Collective backends", [_nccl, _gloo]),
        ("Devices", [_gpus]),
        ("Fusion kernels", [_numba_cuda]),
        ("Launchers", [_ssh, _mpirun]),
    ]
    digest = source_digest()
    sources = f" (sources {digest}: the same on every host of a job)" if digest else ""
    lines = [f"gpucomm v{__version__}{sources}:", ""]
    for title, probes in sections:
        lines.append(f"{title}:")
        for probe in probes:
            ok, text = _probe(probe)
            if ok:
                lines.append(f"    [X] {text}")
            else:
                lines.append(f"    [ ] {probe.__name__.lstrip('_')}: {text}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["check_build_report"]
