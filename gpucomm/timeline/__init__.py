"""The timeline: Horovod's Chrome-trace format, written by rank 0 (``writer``), GPU activities
timed by CUDA events (``gpu``), what gpucomm's paths report (``tracer``), a reader of written
timelines (``reader``), a summary and a renderer (``plot``; ``python -m gpucomm.timeline FILE -o
out.png``).

Importing this package loads neither torch nor matplotlib.
"""

from .cli import main
from .gpu import GpuActivities
from .writer import Timeline, dtype_name, shape_str

__all__ = ["GpuActivities", "Timeline", "dtype_name", "main", "shape_str"]
