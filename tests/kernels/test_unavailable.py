"""Without a GPU and without the simulator, the kernels refuse with a clear KernelUnavailableError."""

from __future__ import annotations

import os

import pytest
import torch

from gpucomm.errors import KernelUnavailableError

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("checks the no-GPU error path; numba is in simulator mode here", allow_module_level=True)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")


def test_pack_without_gpu_or_simulator_says_why_and_what_to_do():
    from gpucomm import kernels
    from gpucomm.errors import GpucommError, KernelUnavailableError

    with pytest.raises(KernelUnavailableError, match="need a GPU") as info:
        kernels.pack([torch.ones(3)], torch.empty(3))
    message = str(info.value)
    assert "gpucomm.dataplane.bucket_copy" in message and "NUMBA_ENABLE_CUDASIM=1" in message
    assert isinstance(info.value, GpucommError)
    with pytest.raises(KernelUnavailableError):
        kernels.unpack(torch.empty(3), [torch.ones(3)], scale=0.5)
    kernels.pack([torch.ones(0)], torch.empty(0))  # nothing to copy: no kernel needed, no error


def test_argument_errors_come_before_availability():
    from gpucomm import kernels

    with pytest.raises(ValueError, match="not contiguous"):
        kernels.pack([torch.ones(3, 3).t()], torch.empty(9))


def test_a_failed_compile_is_remembered_not_retried(monkeypatch):
    """Without a driver the eager compile fails; asking again raises the same error with no new attempt."""
    from numba import cuda

    from gpucomm.kernels import launch, specs

    spec = specs.KERNELS["copy8"]
    launch._failed.pop(spec.name, None)
    attempts = []
    real_jit = cuda.jit
    monkeypatch.setattr(cuda, "jit", lambda *a, **k: (attempts.append(1), real_jit(*a, **k))[1])
    with pytest.raises(KernelUnavailableError, match="compiling the pack kernel 'copy8'") as first:
        launch.compile_kernel(spec, torch.device("cuda", 0))
    with pytest.raises(KernelUnavailableError) as second:
        launch.compile_kernel(spec, torch.device("cuda", 0))
    assert second.value is first.value and len(attempts) == 1
    assert "copy8" not in launch.compiled_names()
    launch._failed.pop(spec.name, None)
