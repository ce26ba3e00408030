"""The kernels build on NumPy 2.5 (which removed ``np.row_stack``) with numba-cuda 0.30.x.

CI's main venv runs Python 3.11 with NumPy 2.4, where NumPy 2.5 cannot be installed (its Python 3.12
step, ``.ci/run``, runs these tests on a real NumPy 2.5 as well), so each test recreates NumPy 2.5's
condition in a fresh interpreter: the removed names are deleted from ``numpy`` before numba-cuda
is imported, then one kernel variant of each kind (``FAMILIES``: a copy, a scale, float64, casts both
ways, a checked pack) is compiled to PTX the way gpucomm compiles it. Without gpucomm's shim
(``gpucomm/kernels/compat.py``) numba-cuda 0.30.4 fails on the first compile. Every variant is compiled
by ``test_compile.py``, on a real NumPy 2.5 too in the Python 3.12 step.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compiles real kernels; numba is in simulator mode here", allow_module_level=True)

from tests.harness import run  # noqa: E402
from tests.kernels.toolchain import toolchain_missing  # noqa: E402

NUMPY_2_5_REMOVED = ("row_stack",)  # names NumPy 2.5 removed that numba-cuda 0.30 still references
FAMILIES = ("copy32", "scale_f32", "scale_f64", "f32_to_bf16_scaled_checked", "f16_to_f32_scaled")

_PROBLEM = toolchain_missing()
pytestmark = pytest.mark.skipif(bool(_PROBLEM), reason=f"cannot compile CUDA kernels here ({_PROBLEM[:160]}); "
                                                       "pip install 'numba-cuda[cu13]'")

SCRIPT = textwrap.dedent(f"""
    import numpy as np
    for name in {NUMPY_2_5_REMOVED!r}:
        if hasattr(np, name):
            delattr(np, name)  # NumPy 2.5's namespace
    import numba.cuda  # numba-cuda loads now, as in a user's process
    from gpucomm import kernels
    from gpucomm.kernels import launch
    for name in {FAMILIES!r}:
        ptx = launch.compile_ptx(kernels.KERNELS[name], (9, 0))
        assert ".entry" in ptx, name
    assert not any(hasattr(np, n) for n in {NUMPY_2_5_REMOVED!r}), "the shim leaked into numpy's namespace"
    print("compiled", {len(FAMILIES)}, "shims", kernels.status()["numpy_shims"])
""")


def _compile_all(env: dict[str, str] | None = None):
    return run([sys.executable, "-c", SCRIPT], timeout=300, env=env)


def test_each_kind_of_kernel_compiles_with_numpy_2_5_names_removed():
    from gpucomm import kernels

    assert set(FAMILIES) <= set(kernels.KERNELS)
    result = _compile_all()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert f"compiled {len(FAMILIES)} shims ('row_stack',)" in result.stdout, result.stdout
    assert not result.leftovers


def test_numba_cuda_fails_there_without_the_shim():
    """The condition the first test recreates is real: numba-cuda alone cannot compile under it."""
    result = _compile_all({"GPUCOMM_NUMBA_COMPAT": "0"})
    if result.returncode == 0:
        pytest.skip("this numba-cuda compiles without the shim; compat.REMOVED_NUMPY_NAMES can shrink")
    assert "row_stack" in result.stderr, result.stderr


def test_nothing_is_shimmed_on_a_numpy_that_has_the_names():
    import numpy as np

    from gpucomm.kernels import compat

    if not all(hasattr(np, n) for n in NUMPY_2_5_REMOVED):
        pytest.skip(f"NumPy {np.__version__} lacks the names itself")
    assert compat.prepare_numba_cuda() == ()
    assert all(hasattr(np, n) for n in NUMPY_2_5_REMOVED)
