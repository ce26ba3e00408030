"""Numba CUDA fusion kernels: one launch packs a list of tensors into a flat buffer, or back.

``pack(srcs, dst)`` / ``unpack(src, dsts)`` take torch tensors. On a GPU they run a Numba kernel
driven by a cached device table of addresses (``table.py``) on torch's stream; with
``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported, the same kernels run in Numba's
simulator on CPU tensors (for tests). Without either they raise ``KernelUnavailableError``.

``BoundCopy`` repeats one bucket's copy at the least host cost (addresses checked, nothing else).
``status()`` says whether this process uses the kernels or settled on torch ops (and why);
``compat.py`` holds the one NumPy 2.5 shim numba-cuda 0.30 needs.

Importing this package is cheap: numba is imported on first use of a name that needs it, so the
CPU path (``gpucomm.dataplane.bucket_copy``) can share ``rules`` without loading Numba.
"""

from __future__ import annotations

from ..errors import KernelUnavailableError
from ..lazy import lazy_dir, lazy_names
from .rules import CASTS, FLOAT_DTYPES, INT_WIDTHS, compute_dtype, conversion, validate

_LAZY = {"pack": "packing", "unpack": "packing", "clear_cache": "packing", "cache_info": "packing", "compile_variant": "packing", "SIMULATOR": "devicefns",
         "KERNELS": "specs", "KernelSpec": "specs", "select_kernel": "specs", "BoundCopy": "bound",
         "status": "availability", "prepare_numba_cuda": "compat"}

__all__ = ["KernelUnavailableError", "CASTS", "FLOAT_DTYPES", "INT_WIDTHS", "compute_dtype", "conversion",
           "validate", *_LAZY]


__getattr__ = lazy_names(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
