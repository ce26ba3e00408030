"""GPU pinning: each process of a job takes the GPU of its local rank.

NVML's enumeration order is not CUDA's, so GPUs are identified by PCI bus id.
gpucomm sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA ordinals follow bus-id
order too.  Everything here imports cleanly without a GPU, driver, torch CUDA or
CuPy; on a CPU machine :func:`pin_local_gpu` returns ``None`` without any output.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from ..errors import DevicePinningError
from ..settings import CPU_AFFINITY, SINGLE_GPU_TEST

__all__ = [
    "DevicePinningError", "GpuInfo", "PinnedDevice", "normalize_bus_id", "nvml_gpus",
    "visible_gpus", "select_gpu", "check_unique_assignment", "pin_local_gpu",
    "cuda_bus_ids", "cuda_ordinal_for_bus_id", "device_in_use", "select_device", "bind_cpu_affinity", "single_gpu_test_enabled",
    "apply_single_gpu_test_env",
]

log = logging.getLogger(__name__)

_BUS_ID_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<dev>[0-9a-f]{1,2})(?:\.(?P<fn>[0-7]))?$"
)
_FIX_SINGLE_GPU = "set GPUCOMM_SINGLE_GPU_TEST=1 to test several ranks on one GPU"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it; ``pci_bus_id`` is normalised (see normalize_bus_id)."""

    nvml_index: int
    pci_bus_id: str
    uuid: str
    name: str
    memory_total: int


@dataclass(frozen=True)
class PinnedDevice:
    """The GPU this process was pinned to and its CUDA ordinal in this process."""

    gpu: GpuInfo
    cuda_ordinal: int


def _parse_bus_id(bus_id: str | bytes) -> tuple[int, int, int, int]:
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _BUS_ID_RE.match(bus_id.strip().strip("\x00").lower())
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return (int(m["domain"] or "0", 16), int(m["bus"], 16), int(m["dev"], 16), int(m["fn"] or "0"))


def normalize_bus_id(bus_id: str | bytes) -> str:
    """Return a PCI bus id as ``dddd:bb:dd.f`` in lower case.

    NVML writes ``00000000:3B:00.0``, CUDA ``0000:3B:00.0``; normalising lets them compare.
    """
    domain, bus, dev, fn = _parse_bus_id(bus_id)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def nvml_gpus() -> list[GpuInfo]:
    """All GPUs NVML sees, sorted by PCI bus id; ``[]`` without NVML, driver or GPUs.

    A CPU-only machine is a normal case, so a missing library or driver is only
    logged at debug level.
    """
    try:
        import pynvml
    except ImportError:
        log.debug("pynvml is not installed; no GPUs")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable (%s); no GPUs", exc)
        return []
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(GpuInfo(
                    nvml_index=i,
                    pci_bus_id=normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                ))
            except pynvml.NVMLError as exc:
                log.warning("skipping GPU %d, NVML cannot query it: %s", i, exc)
    except pynvml.NVMLError as exc:
        log.debug("NVML cannot count GPUs (%s); no GPUs", exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return sorted(gpus, key=lambda g: _parse_bus_id(g.pci_bus_id))


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def visible_gpus(gpus: list[GpuInfo], cuda_visible_devices: str | None) -> list[GpuInfo]:
    """Apply ``CUDA_VISIBLE_DEVICES`` to ``gpus``, as CUDA would (in PCI_BUS_ID order).

    Tokens are indices into the bus-id-sorted list, or GPU UUIDs / unique UUID
    prefixes; the result keeps the listed order.  Like CUDA, the first invalid
    token (unknown, ambiguous, out of range, repeated) ends the list.
    """
    ordered = sorted(gpus, key=lambda g: _parse_bus_id(g.pci_bus_id))
    if cuda_visible_devices is None:
        return ordered
    tokens = [t.strip() for t in cuda_visible_devices.split(",")]
    if any(t.upper().startswith("MIG-") for t in tokens):
        raise DevicePinningError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names MIG instances, which gpucomm "
            "does not support for GPU pinning: all MIG instances of a GPU share its PCI bus id, "
            "so they cannot be told apart. Use whole GPUs (GPU indices or GPU-UUIDs in "
            "CUDA_VISIBLE_DEVICES, or leave it unset)."
        )
    result: list[GpuInfo] = []
    for token in tokens:
        gpu = _match_token(ordered, token)
        if gpu is None or gpu in result:
            break
        result.append(gpu)
    return result


def _match_token(ordered: list[GpuInfo], token: str) -> GpuInfo | None:
    if re.fullmatch(r"[0-9]+", token):
        index = int(token)
        return ordered[index] if index < len(ordered) else None
    if not token.upper().startswith("GPU-"):
        return None
    matches = [g for g in ordered if g.uuid.lower().startswith(token.lower())]
    return matches[0] if len(matches) == 1 else None


def select_gpu(
    local_rank: int, local_size: int, visible: list[GpuInfo], *, single_gpu_test: bool, hostname: str = ""
) -> tuple[GpuInfo, int]:
    """Choose the GPU of ``local_rank``: ``(gpu, index in visible)``.

    The index is the CUDA ordinal when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.  One visible
    GPU for several local ranks is accepted (launchers such as Slurm
    ``--gpus-per-task`` give each process its own); check_unique_assignment catches
    real sharing.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank {local_rank} is not in [0, {local_size})")
    host = hostname or "this host"
    if single_gpu_test:
        if not visible:
            raise DevicePinningError(f"single-GPU test mode, but no GPU is visible on {host}")
        return visible[0], 0
    if len(visible) >= local_size:
        return visible[local_rank], local_rank
    if len(visible) == 1:
        return visible[0], 0
    raise DevicePinningError(
        f"local ranks ({local_size}) outnumber the GPUs visible to this process "
        f"({len(visible)}) on host {host}: each process needs its own GPU. Causes: too many "
        f"processes started on this host, or CUDA_VISIBLE_DEVICES lists too few GPUs. "
        f"Fix: start at most {len(visible)} processes per host (e.g. `gpucomm-run -H "
        f"{hostname or 'host'}:{len(visible)}`), widen CUDA_VISIBLE_DEVICES, or "
        f"{_FIX_SINGLE_GPU}."
    )


def check_unique_assignment(assignments: Sequence[tuple[int, str, str]], *, single_gpu_test: bool) -> None:
    """Raise if two ranks on one host hold the same GPU.

    ``assignments`` holds ``(rank, hostname, pci_bus_id)`` of every rank.  NCCL would
    later fail with a cryptic "Duplicate GPU detected"; this says what went wrong.
    """
    if single_gpu_test:
        return
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, host, bus_id in assignments:
        groups[(host, normalize_bus_id(bus_id))].append(rank)
    clashes = [f"ranks {sorted(r)} on host {h or '?'} all hold GPU {b}"
               for (h, b), r in sorted(groups.items()) if len(r) > 1]
    if clashes:
        raise DevicePinningError(
            "several ranks were pinned to one GPU: " + "; ".join(clashes) + ". Causes: "
            "CUDA_VISIBLE_DEVICES set to the same GPU for every process, or wrong local "
            "ranks (the launcher's LOCAL_RANK is not set). Fix: give each process on a host "
            f"its own GPU (distinct CUDA_VISIBLE_DEVICES, or leave it unset), or {_FIX_SINGLE_GPU}."
        )


def cuda_bus_ids() -> list[str]:
    """The PCI bus id of every CUDA device of this process, by CUDA ordinal (CUDA's own answer:
    whatever device order and ``CUDA_VISIBLE_DEVICES`` it started with); ``[]`` without CUDA.
    Asks torch, else CuPy; creates no CUDA context."""
    try:
        import torch

        if torch.cuda.is_available():
            ids = []
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                if not all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
                    break  # a torch too old to say: ask CuPy
                ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
            else:
                return ids
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.is_available():
            return [normalize_bus_id(cupy.cuda.runtime.deviceGetPCIBusId(i))
                    for i in range(cupy.cuda.runtime.getDeviceCount())]
    except ImportError:
        pass
    return []


def cuda_ordinal_for_bus_id(bus_id: str) -> int:
    """The CUDA ordinal in this process of the GPU at ``bus_id``, asked of CUDA itself (so any
    device order is right, also one fixed before gpucomm set ``CUDA_DEVICE_ORDER``)."""
    want = _parse_bus_id(bus_id)[:3]  # domain, bus, device: CUDA omits the function
    ids = cuda_bus_ids()
    for ordinal, theirs in enumerate(ids):
        if _parse_bus_id(theirs)[:3] == want:
            return ordinal
    raise DevicePinningError(
        f"no CUDA device of this process has PCI bus id {bus_id} (CUDA sees {ids or 'no devices'}), although NVML "
        f"lists that GPU. Likely causes: CUDA_VISIBLE_DEVICES hides it from CUDA but not from gpucomm's view, or "
        f"torch/CuPy cannot use the driver. Fix: check CUDA_VISIBLE_DEVICES and `python -c 'import torch; "
        f"print(torch.cuda.device_count())'`.")


def _as_cuda_sees(gpus: list[GpuInfo], cuda_ids: list[str], *, listed: bool) -> list[GpuInfo]:
    """The NVML entries of the GPUs CUDA exposes: in CUDA's order when CUDA_VISIBLE_DEVICES lists
    them (local rank r takes the r-th listed), else in bus-id order (local rank r takes the r-th
    GPU by bus id, whatever device order CUDA started with)."""
    by_bus = {_parse_bus_id(g.pci_bus_id)[:3]: g for g in gpus}
    seen = [by_bus[key] for key in (_parse_bus_id(b)[:3] for b in cuda_ids) if key in by_bus]
    return seen if listed else sorted(seen, key=lambda g: _parse_bus_id(g.pci_bus_id))


def device_in_use() -> int | None:
    """The calling thread's current CUDA device if this process has started CUDA already (the script
    chose a GPU before ``hvd.init()``), else None. Starts nothing: read it before anything of gpucomm's
    may start CUDA (the GPU probing of ``pin_local_gpu`` does), or a device 0 nobody chose looks chosen.
    Not even the driver: ``torch.cuda.is_available()`` runs ``cuInit``, which reads ``CUDA_DEVICE_ORDER``
    once, before ``pin_local_gpu`` sets it to bus order; ``is_initialized()`` reads a flag."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def select_device(ordinal: int) -> None:
    """Make CUDA ordinal ``ordinal`` the current device of the calling thread, for torch and CuPy
    (one ``cudaSetDevice``: both read CUDA's per-thread current device). Every thread of gpucomm
    that touches CUDA calls this first: a thread that has not selected a device works on device
    0, and its first CUDA call there creates a context on GPU 0 (~0.5 GiB) for every rank."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(ordinal)
        return
    try:
        import cupy
    except ImportError:
        return
    if cupy.cuda.is_available():
        cupy.cuda.Device(ordinal).use()


def bind_cpu_affinity(gpu: GpuInfo) -> bool:
    """Bind this process to the CPUs near ``gpu`` (its NUMA node); False if not possible."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: nothing to bind to
        return False
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.pci_bus_id)
        words = pynvml.nvmlDeviceGetCpuAffinity(handle, ((os.cpu_count() or 1) + 63) // 64)
        near = {w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1}
        cpus = near & os.sched_getaffinity(0)  # stay inside cgroup / taskset limits
        if not cpus:
            return False
        os.sched_setaffinity(0, cpus)
        return True
    except (pynvml.NVMLError, AttributeError, OSError) as exc:
        log.debug("cannot bind CPU affinity for GPU %s: %s", gpu.pci_bus_id, exc)
        return False
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def pin_local_gpu(
    local_rank: int, local_size: int, *, single_gpu_test: bool = False,
    env: MutableMapping[str, str] | None = None, hostname: str = "",
) -> PinnedDevice | None:
    """Pin this process to the GPU of its local rank; ``None`` on a CPU-only machine.

    ``env`` (default ``os.environ``) gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless set (so
    ``cuda:N`` follows bus order where CUDA starts after this); the ordinal is always the one
    CUDA reports for the GPU's bus id.  Binds CPU affinity if ``GPUCOMM_CPU_AFFINITY`` is truthy.
    """
    env = os.environ if env is None else env
    gpus = nvml_gpus()
    if not gpus:
        return None
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    visible = visible_gpus(gpus, env.get("CUDA_VISIBLE_DEVICES"))  # NVML's reading (and the MIG check)
    cuda_ids = cuda_bus_ids()
    if cuda_ids:  # CUDA's own view wins: it read CUDA_VISIBLE_DEVICES in the device order it started with
        visible = _as_cuda_sees(gpus, cuda_ids, listed=env.get("CUDA_VISIBLE_DEVICES") is not None)
    if not visible:
        log.debug("CUDA_VISIBLE_DEVICES hides every GPU; running on CPU")
        return None
    gpu, _ = select_gpu(local_rank, local_size, visible, single_gpu_test=single_gpu_test, hostname=hostname)
    # CUDA's own answer, never the index into NVML's list: ``torch.cuda.is_available()`` (which
    # Horovod's examples call before ``hvd.init()``) may already have fixed the driver's device
    # order before CUDA_DEVICE_ORDER was set here, and on a host with mixed GPU models that order
    # is not the bus-id order.
    ordinal = cuda_ordinal_for_bus_id(gpu.pci_bus_id)
    select_device(ordinal)
    if CPU_AFFINITY.read(env, False):
        bind_cpu_affinity(gpu)
    return PinnedDevice(gpu=gpu, cuda_ordinal=ordinal)


def single_gpu_test_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``GPUCOMM_SINGLE_GPU_TEST`` asks for several ranks on one GPU."""
    return SINGLE_GPU_TEST.read(env, False)


def apply_single_gpu_test_env(rank: int, env: MutableMapping[str, str]) -> None:
    """Set the NCCL variables that let N ranks share one GPU; user-set values win.

    Call before NCCL initialises.  Why each one:

    - ``NCCL_HOSTID=gpucomm-test-host-<rank>``: NCCL groups ranks into hosts by a host
      hash and refuses two ranks of one host on one GPU ("Duplicate GPU detected");
      a distinct host id per rank makes every rank a host of its own.
    - ``NCCL_P2P_DISABLE=1``: CUDA peer-to-peer / IPC between a device and itself
      across processes is pointless and can fail; keep NCCL off that path.
    - ``NCCL_SHM_DISABLE=1``: no shared-memory transport between the pretend hosts.
    - ``NCCL_IB_DISABLE=1``: use plain sockets, not InfiniBand/RoCE, to talk to oneself.
    - ``NCCL_SOCKET_IFNAME=lo``: every rank is on this machine, so loopback always
      works (NCCL otherwise skips ``lo`` and may pick an interface that cannot).
    """
    env.setdefault("NCCL_HOSTID", f"gpucomm-test-host-{rank}")
    env.setdefault("NCCL_P2P_DISABLE", "1")
    env.setdefault("NCCL_SHM_DISABLE", "1")
    env.setdefault("NCCL_IB_DISABLE", "1")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
