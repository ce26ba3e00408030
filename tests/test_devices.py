"""Tests for gpucomm.bootstrap.devices: pure pinning logic, CPU-machine behaviour, and GPU checks."""

from __future__ import annotations

import os
import warnings

import pytest

from gpucomm.bootstrap import devices
from gpucomm.bootstrap.devices import (
    DevicePinningError,
    GpuInfo,
    apply_single_gpu_test_env,
    check_unique_assignment,
    normalize_bus_id,
    nvml_gpus,
    pin_local_gpu,
    select_gpu,
    single_gpu_test_enabled,
    visible_gpus,
)

# Four GPUs in PCI-bus-id order; NVML enumerated them in a different order.
G0 = GpuInfo(2, "0000:1a:00.0", "GPU-aaaa1111-0000-0000-0000-000000000000", "Test GPU", 80 << 30)
G1 = GpuInfo(0, "0000:3b:00.0", "GPU-aaaa2222-0000-0000-0000-000000000000", "Test GPU", 80 << 30)
G2 = GpuInfo(3, "0000:88:00.0", "GPU-bbbb3333-0000-0000-0000-000000000000", "Test GPU", 80 << 30)
G3 = GpuInfo(1, "0001:05:00.0", "GPU-cccc4444-0000-0000-0000-000000000000", "Test GPU", 80 << 30)
ALL = [G0, G1, G2, G3]
SHUFFLED = [G1, G3, G0, G2]


# --- normalize_bus_id -------------------------------------------------------

@pytest.mark.parametrize("raw", [
    "00000000:3B:00.0", b"00000000:3B:00.0", "0000:3B:00.0", "0000:3b:00.0", "3b:00.0",
    " 00000000:3b:00.0\x00",
])
def test_normalize_bus_id_forms(raw):
    assert normalize_bus_id(raw) == "0000:3b:00.0"


def test_normalize_bus_id_keeps_domain_and_function():
    assert normalize_bus_id("00000001:DB:1F.3") == "0001:db:1f.3"


def test_normalize_bus_id_rejects_garbage():
    with pytest.raises(ValueError):
        normalize_bus_id("not-a-bus-id")


# --- visible_gpus -----------------------------------------------------------

def test_visible_unset_is_all_sorted_by_bus_id():
    assert visible_gpus(SHUFFLED, None) == ALL


def test_visible_indices_in_bus_id_order_and_listed_order():
    assert visible_gpus(SHUFFLED, "0,1") == [G0, G1]
    assert visible_gpus(SHUFFLED, "3,0, 2") == [G3, G0, G2]


def test_visible_uuid_and_prefix():
    assert visible_gpus(ALL, G2.uuid) == [G2]
    assert visible_gpus(ALL, "GPU-cccc,GPU-aaaa1") == [G3, G0]
    assert visible_gpus(ALL, "gpu-BBBB3333") == [G2]


def test_visible_empty_string_hides_all():
    assert visible_gpus(ALL, "") == []


@pytest.mark.parametrize("cvd, expected", [
    ("1,7,2", [G1]),          # out of range
    ("2,GPU-aaaa,0", [G2]),   # ambiguous prefix
    ("0,GPU-ffff,1", [G0]),   # unknown UUID
    ("-1", []),               # the usual "hide all GPUs" idiom
    ("1,foo,2", [G1]),        # not an index or a UUID
    ("0,,1", [G0]),           # empty token
    ("1,1,2", [G1]),          # repeated device
])
def test_visible_invalid_token_ends_list(cvd, expected):
    assert visible_gpus(ALL, cvd) == expected


def test_visible_mig_is_unsupported():
    with pytest.raises(DevicePinningError, match="MIG instances.*not support"):
        visible_gpus(ALL, "MIG-0123abcd-0000-0000-0000-000000000000")


# --- select_gpu -------------------------------------------------------------

def test_select_one_gpu_per_rank():
    for rank in range(4):
        assert select_gpu(rank, 4, ALL, single_gpu_test=False) == (ALL[rank], rank)


def test_select_more_gpus_than_ranks():
    assert select_gpu(1, 2, ALL, single_gpu_test=False) == (G1, 1)


def test_select_fewer_gpus_than_ranks_explains():
    with pytest.raises(DevicePinningError) as err:
        select_gpu(0, 8, [G0, G1], single_gpu_test=False, hostname="node7")
    msg = str(err.value)
    assert "local ranks (8) outnumber the GPUs visible to this process (2) on host node7" in msg
    assert "CUDA_VISIBLE_DEVICES" in msg
    assert "gpucomm-run -H node7:2" in msg
    assert "GPUCOMM_SINGLE_GPU_TEST=1" in msg


def test_select_no_visible_gpu_is_an_error():
    with pytest.raises(DevicePinningError, match=r"\(0\)"):
        select_gpu(0, 2, [], single_gpu_test=False)


def test_select_one_visible_gpu_per_process():
    # e.g. Slurm --gpus-per-task=1: every process sees only its own GPU.
    for rank in range(4):
        assert select_gpu(rank, 4, [G2], single_gpu_test=False) == (G2, 0)


def test_select_single_gpu_test_shares_first_gpu():
    for rank in range(8):
        assert select_gpu(rank, 8, [G1, G2], single_gpu_test=True) == (G1, 0)
    with pytest.raises(DevicePinningError):
        select_gpu(0, 2, [], single_gpu_test=True)


def test_select_rejects_bad_local_rank():
    with pytest.raises(ValueError):
        select_gpu(4, 4, ALL, single_gpu_test=False)


# --- check_unique_assignment ------------------------------------------------

def test_unique_assignment_ok():
    check_unique_assignment(
        [(0, "a", G0.pci_bus_id), (1, "a", G1.pci_bus_id), (2, "b", G0.pci_bus_id), (3, "b", G1.pci_bus_id)],
        single_gpu_test=False,
    )


def test_unique_assignment_duplicate_names_ranks_and_host():
    with pytest.raises(DevicePinningError) as err:
        check_unique_assignment(
            [(0, "nodeA", G0.pci_bus_id), (1, "nodeA", "00000000:1A:00.0"), (2, "nodeB", G0.pci_bus_id)],
            single_gpu_test=False,
        )
    msg = str(err.value)
    assert "ranks [0, 1]" in msg and "nodeA" in msg and G0.pci_bus_id in msg
    assert "nodeB" not in msg
    assert "LOCAL_RANK" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_unique_assignment_single_gpu_test_allows_sharing():
    check_unique_assignment([(r, "nodeA", G0.pci_bus_id) for r in range(4)], single_gpu_test=True)


def test_unique_assignment_same_bus_id_on_other_hosts_is_fine():
    check_unique_assignment([(r, f"node{r}", G0.pci_bus_id) for r in range(4)], single_gpu_test=False)


# --- env helpers ------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("YES", True), ("On", True),
    ("0", False), ("false", False), ("", False),
])
def test_single_gpu_test_enabled(value, expected):
    assert single_gpu_test_enabled({"GPUCOMM_SINGLE_GPU_TEST": value}) is expected


def test_single_gpu_test_refuses_what_is_not_a_boolean():
    with pytest.raises(ValueError, match="GPUCOMM_SINGLE_GPU_TEST='2' is not a boolean"):
        single_gpu_test_enabled({"GPUCOMM_SINGLE_GPU_TEST": "2"})


def test_single_gpu_test_enabled_unset():
    assert single_gpu_test_enabled({}) is False


def test_apply_single_gpu_test_env_sets_defaults():
    env: dict[str, str] = {}
    apply_single_gpu_test_env(3, env)
    assert env == {
        "NCCL_HOSTID": "gpucomm-test-host-3", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
    }


def test_apply_single_gpu_test_env_keeps_user_values():
    env = {"NCCL_HOSTID": "mine", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_P2P_DISABLE": "0"}
    apply_single_gpu_test_env(1, env)
    assert env["NCCL_HOSTID"] == "mine"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_P2P_DISABLE"] == "0"
    assert env["NCCL_SHM_DISABLE"] == "1"


# --- pin_local_gpu flow with given GPU lists (no CUDA calls) -----------------

@pytest.fixture
def fake_gpus(monkeypatch):
    """NVML's answer is SHUFFLED and CUDA's (every device, bus-id order) is ALL; records the
    ordinal pin_local_gpu selects."""
    activated: list[int] = []
    monkeypatch.setattr(devices, "nvml_gpus", lambda: list(SHUFFLED))
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [g.pci_bus_id for g in ALL])
    monkeypatch.setattr(devices, "select_device", activated.append)
    return activated


def test_pin_sets_device_order_and_uses_bus_id_index(fake_gpus):
    env: dict[str, str] = {}
    pinned = pin_local_gpu(2, 4, env=env)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert pinned == devices.PinnedDevice(G2, 2)
    assert fake_gpus == [2]


def test_pin_respects_cuda_visible_devices(fake_gpus, monkeypatch):
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [G3.pci_bus_id, G1.pci_bus_id])  # CUDA sees "3,1"
    pinned = pin_local_gpu(1, 2, env={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert pinned == devices.PinnedDevice(G1, 1)


def test_pin_takes_cudas_ordinal_when_the_driver_order_was_fixed_earlier(monkeypatch):
    """A host with two GPU models: the script called torch.cuda.is_available() before
    hvd.init(), so CUDA enumerated FASTEST_FIRST (the faster GPU, at the higher bus id, is
    ordinal 0) before gpucomm set CUDA_DEVICE_ORDER. Local rank 0 owns the GPU at the lowest bus
    id, which is CUDA ordinal 1 here: the bus-id index (0) would be the other rank's GPU."""
    slow = GpuInfo(0, "0000:1a:00.0", "GPU-slow0000-0000-0000-0000-000000000000", "Slow GPU", 16 << 30)
    fast = GpuInfo(1, "0000:3b:00.0", "GPU-fast0000-0000-0000-0000-000000000000", "Fast GPU", 80 << 30)
    selected: list[int] = []
    monkeypatch.setattr(devices, "nvml_gpus", lambda: [slow, fast])  # NVML's answer
    monkeypatch.setattr(devices, "select_device", selected.append, raising=False)
    monkeypatch.setattr(devices, "_activate_ordinal", selected.append, raising=False)  # its name before
    import torch  # torch's answer: two devices, the fast one first, CUDA itself not initialised yet

    props = {0: (0, 0x3B, 0), 1: (0, 0x1A, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("Props", (), dict(zip(
        ("pci_domain_id", "pci_bus_id", "pci_device_id"), props[i])))())
    pinned = pin_local_gpu(0, 2, env={})
    assert pinned == devices.PinnedDevice(slow, 1)
    assert selected == [1]


def test_pin_outnumbered_raises(fake_gpus):
    with pytest.raises(DevicePinningError, match=r"local ranks \(8\).*\(4\)"):
        pin_local_gpu(0, 8, env={}, hostname="h")


def test_pin_all_hidden_returns_none(fake_gpus, monkeypatch):
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [])  # what CUDA sees with CUDA_VISIBLE_DEVICES=""
    assert pin_local_gpu(0, 2, env={"CUDA_VISIBLE_DEVICES": ""}) is None
    assert fake_gpus == []


def test_pin_other_device_order_matches_by_bus_id(fake_gpus, monkeypatch):
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [G1.pci_bus_id, G0.pci_bus_id, G3.pci_bus_id, G2.pci_bus_id])
    pinned = pin_local_gpu(1, 4, env={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert pinned == devices.PinnedDevice(G1, 0)


def test_pin_names_the_gpu_cuda_cannot_see(fake_gpus, monkeypatch):
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [])  # NVML lists GPUs, CUDA cannot use any
    with pytest.raises(DevicePinningError, match="no CUDA device of this process has PCI bus id 0000:3b:00.0"):
        pin_local_gpu(1, 4, env={})


def test_pin_reads_cuda_visible_devices_as_cuda_did(fake_gpus, monkeypatch):
    """CUDA started FASTEST_FIRST before gpucomm set the order, so CUDA_VISIBLE_DEVICES=0,1 named the two
    fastest GPUs (G2 and G3 here), not the first two by bus id: the local ranks get those two."""
    monkeypatch.setattr(devices, "cuda_bus_ids", lambda: [G3.pci_bus_id, G2.pci_bus_id])
    assert pin_local_gpu(0, 2, env={"CUDA_VISIBLE_DEVICES": "0,1"}) == devices.PinnedDevice(G3, 0)
    assert pin_local_gpu(1, 2, env={"CUDA_VISIBLE_DEVICES": "0,1"}) == devices.PinnedDevice(G2, 1)


# --- real behaviour on this machine -----------------------------------------

NVML_GPUS = nvml_gpus()
requires_gpu = pytest.mark.skipif(not NVML_GPUS, reason="NVML finds no GPU on this machine")
no_gpu_only = pytest.mark.skipif(bool(NVML_GPUS), reason="this machine has a GPU")


@no_gpu_only
def test_nvml_gpus_empty_and_silent_without_gpu(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nvml_gpus() == []
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@no_gpu_only
def test_pin_local_gpu_none_quietly_without_gpu(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pin_local_gpu(0, 1, env={}) is None
        assert pin_local_gpu(3, 8, env={}) is None
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@no_gpu_only
def test_bind_cpu_affinity_false_without_nvml():
    assert devices.bind_cpu_affinity(G0) is False


# --- GPU machine ------------------------------------------------------------

def _torch_bus_id(ordinal: int) -> str:
    import torch

    p = torch.cuda.get_device_properties(ordinal)
    return normalize_bus_id(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")


@pytest.mark.gpu
@requires_gpu
def test_gpu_nvml_gpus_normalised():
    for gpu in NVML_GPUS:
        assert gpu.pci_bus_id == normalize_bus_id(gpu.pci_bus_id)
        assert gpu.uuid.startswith("GPU-") and gpu.memory_total > 0
    assert [g.pci_bus_id for g in NVML_GPUS] == sorted(g.pci_bus_id for g in NVML_GPUS)


@pytest.mark.gpu
@requires_gpu
def test_gpu_pin_local_gpu_matches_torch_bus_id(monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    pinned = pin_local_gpu(0, 1)
    assert pinned is not None
    assert torch.cuda.current_device() == pinned.cuda_ordinal
    assert _torch_bus_id(pinned.cuda_ordinal)[:10] == pinned.gpu.pci_bus_id[:10]
    assert devices.cuda_ordinal_for_bus_id(pinned.gpu.pci_bus_id) == pinned.cuda_ordinal


@pytest.mark.gpu
@requires_gpu
def test_gpu_single_gpu_mode_pins_every_rank_to_one_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    pinned = [pin_local_gpu(r, 4, single_gpu_test=True) for r in range(4)]
    assert all(p is not None for p in pinned)
    assert len({p.gpu.pci_bus_id for p in pinned}) == 1
    assert len({p.cuda_ordinal for p in pinned}) == 1
    check_unique_assignment([(r, "h", p.gpu.pci_bus_id) for r, p in enumerate(pinned)], single_gpu_test=True)
    assert os.environ.get("CUDA_DEVICE_ORDER")
