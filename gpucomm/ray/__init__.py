"""gpucomm on Ray: Horovod's ``horovod.ray`` API (``import gpucomm.ray`` replaces it) and a Ray Train
backend.

* ``RayExecutor``: a fixed-size (or, with ``min_workers``, elastic) job of worker actors;
* ``ElasticRayExecutor``: an elastic job over the cluster's slots;
* ``ray_logger.log``: values from the workers to the driver's callbacks;
* ``GpucommConfig`` / ``GpucommTrainer``: gpucomm as a backend of Ray Train's data-parallel trainer.

The driver serves each job's authenticated rendezvous store, as ``gpucomm-run`` does; the workers
are Ray actors placed by Ray, ranked by where they landed. Needs ``pip install "gpucomm[ray]"``.
Names load on first use: ``import gpucomm.ray`` does not import Ray Train.
"""

from __future__ import annotations

from ..lazy import lazy_dir, lazy_names

_LAZY = {"RayExecutor": "executor", "ElasticRayExecutor": "elastic", "BaseGpucommWorker": "worker",
         "BaseHorovodWorker": "worker", "RayHostDiscovery": "discovery", "ray_logger": "ray_logger",
         "GpucommConfig": "train", "GpucommTrainer": "train", "GpucommBackend": "train"}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY, globals())
__dir__ = lazy_dir(_LAZY, globals())
