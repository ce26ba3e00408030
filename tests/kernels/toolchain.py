"""Whether this machine can compile CUDA kernels, and why not: a test skips only when a toolkit
library is missing (the fix is an install), and fails on any other compile error (a real break)."""

from __future__ import annotations

MISSING_LIBRARY_ERRORS = {"DynamicLibNotFoundError", "NvvmSupportError", "NvrtcSupportError", "CudaSupportError"}


def missing_library(error: BaseException) -> bool:
    """True if ``error`` (or what caused it) says a toolkit library or binding is not installed."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in MISSING_LIBRARY_ERRORS or isinstance(error, ImportError):
            return True
        error = error.__cause__ or error.__context__
    return False


def toolchain_missing() -> str:
    """"" when kernels compile to PTX and nvJitLink imports; the missing piece when a library is
    absent; raises any other error (numba-cuda or this stack is broken: the test must fail)."""
    from numba import cuda  # noqa: PLC0415
    from numba.cuda import types  # noqa: PLC0415

    from gpucomm.kernels import compat  # noqa: PLC0415

    def probe(x):
        x[0] = 1

    try:
        compat.prepare_numba_cuda()
        cuda.compile_ptx(probe, (types.int32[::1],), cc=(9, 0))
        from cuda.bindings import nvjitlink  # noqa: F401, PLC0415
    except Exception as e:
        if missing_library(e):
            return f"{type(e).__name__}: {e}"
        raise
    return ""
