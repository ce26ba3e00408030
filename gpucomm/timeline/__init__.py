"""The timeline: Horovod's Chrome-trace format, written by rank 0 (``writer``), GPU activities
timed by CUDA events (``gpu``), what gpucomm's paths report (``tracing``), and a renderer
(``plot``; ``python -m gpucomm.timeline FILE -o out.png``).

Importing this package loads neither torch nor matplotlib.
"""

from .writer import Timeline, dtype_name, shape_str

__all__ = ["GpuActivities", "Timeline", "dtype_name", "main", "shape_str"]


def __getattr__(name: str):
    if name == "GpuActivities":
        from .gpu import GpuActivities

        return GpuActivities
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(f"module 'gpucomm.timeline' has no attribute {name!r}")
