"""The collectives benchmark (``benchmarks/collectives.py``) in pieces, as nccl-tests splits its own into a
common driver (``src/common.cu``) and one small file per collective.

The driver, shared by every collective and implementation:

    sizes         nccl-tests' sweep, element counts per collective and bus-bandwidth factors
    inputs        the exact integer inputs each rank sends, and the buffers that hold them
    expected      what every rank must hold after a call, and the #wrong count against it
    timing        one call timed (warm-up, untimed call, barrier, -n calls) and checked
    results       a row's and a table's numbers, the ranks' agreement on them, medians of rounds
    sweep_loop    sizes x cases x implementations, table by table, interruptible
    printing      nccl-tests' table layout and preamble, printed by rank 0
    summary       the closing lines: average bandwidth per table, gpucomm beside its anchor
    environment   the job's devices, versions and gpucomm counters for the JSON
    results_json  the JSON file;  plot: the PNG
    cli           the command line, its defaults and its checks
    report        rank 0's closing summary and files, also after an interruption

One module per implementation, each the same five collectives:

    impl_base     what an implementation provides, and the implementations' names in run order
    impl_gpucomm  gpucomm (``import gpucomm.torch as hvd``): the code under test
    impl_torch    torch.distributed: the anchor a user would otherwise write
    impl_nccl     raw CuPy NCCL: the floor gpucomm's dispatch adds to (CUDA only)
    impl_choice   which implementations can run here, built in a fixed order
"""

from __future__ import annotations

import os
import sys

# benchmarks/ holds the helpers shared with the other benchmarks (anchors, bench_stats, torch_group)
_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
