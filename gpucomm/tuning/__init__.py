"""A model of a data-parallel training step, and the bucket plan that minimises it.

Pure Python (no torch, no GPU) at its core:

- ``costs``: collective cost curves, ``AlphaBeta`` and ``fit_alpha_beta`` from measured samples, or
  ``MeasuredCurve`` through the samples themselves;
- ``nccl``: NCCL's published cost model (ring and tree, 2.30.7 constants) for clusters we do not have;
- ``transport``: RDMA or plain TCP under it (NCCL's socket transport: threads, sockets, host cost per byte);
- ``step``: the step as gpucomm schedules it (buckets in index order, one at a time on one stream);
- ``optimal``: the exact best contiguous bucket cuts in ready order (an O(n²) dynamic program);
- ``policies``: other systems' plans (gpucomm's and DDP's fixed caps, Horovod's cycle);
- ``profile`` / ``predict``: a model's ready times and sizes in, predicted step and efficiency out;
- ``straggler``: the wait for the slowest rank of a synchronous step (per-rank noise, ``E[max]``).

Torch-side helpers load only when imported: ``measure`` (profile a model on a device), ``flops``
(an analytic profile from the architecture) and ``plans`` (a plan as ``fusion.Bucket`` records or
``DistributedOptimizer(groups=...)`` lists).
"""

from .costs import AlphaBeta, CostFn, FitError, MeasuredCurve, fit_alpha_beta, medians, ring_allreduce
from .nccl import NCCL_VERSION, Cluster, Graph, NcclModel, graph_for
from .optimal import OptimalPlan, buckets_from_cuts, optimal_plan, ready_order
from .policies import capped_buckets, cycle_schedule
from .predict import Prediction, predict_step, scaling_efficiency
from .profile import Profile
from .step import BucketTiming, Overheads, StepPrediction, simulate
from .straggler import Stragglers, expected_max_normal, fit_cv
from .transport import TRANSPORTS, Socket

__all__ = [
    "AlphaBeta", "CostFn", "FitError", "MeasuredCurve", "fit_alpha_beta", "medians", "ring_allreduce",
    "NCCL_VERSION", "Cluster", "Graph", "NcclModel", "graph_for",
    "OptimalPlan", "buckets_from_cuts", "optimal_plan", "ready_order",
    "capped_buckets", "cycle_schedule",
    "Prediction", "predict_step", "scaling_efficiency",
    "Profile",
    "BucketTiming", "Overheads", "StepPrediction", "simulate",
    "Stragglers", "expected_max_normal", "fit_cv",
    "TRANSPORTS", "Socket",
]
