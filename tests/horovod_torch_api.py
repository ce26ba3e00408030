"""The public API of ``horovod.torch`` 0.28.1, written out as data (horovod is never imported).

Read from Horovod's source at tag ``v0.28.1``: ``horovod/torch/__init__.py`` and what it re-exports
from ``mpi_ops.py`` (whose lifecycle and query functions are ``horovod/common/basics.py``'s
``HorovodBasics`` methods, bound), ``functions.py``, ``optimizer.py``, ``compression.py``,
``sync_batch_norm.py``, ``horovod/common/process_sets.py`` and the ``elastic`` subpackage. Only facts
are recorded here: names, parameters (name, kind, position, default) and the public methods users
call. What gpucomm decides about them lives in ``test_api_parity.py``.

Notes on the sources:
- ``mpi_ops.init`` / ``mpi_ops.shutdown`` are ``(*args, **kwargs)`` wrappers that forward to
  ``HorovodBasics.init(comm=None, process_sets=None)`` / ``shutdown()``; the forwarded signature is
  the one users see documented and is recorded.
- Every Horovod parameter is positional-or-keyword (no keyword-only parameters anywhere).
- ``Average``..``Product`` are plain ints from the C enum ``ReduceOp`` (message.h): 0..5.
- ``HostsUpdatedInterrupt`` is not a ``horovod.torch`` name: elastic scripts import it from
  ``horovod.common.exceptions`` (recorded in ``COMMON_EXCEPTIONS``).
- ``is_homogeneous`` is defined in ``horovod.torch.mpi_ops`` but not re-exported by
  ``horovod.torch`` (recorded in ``MPI_OPS_ONLY``; issue 19 asks gpucomm to offer it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HOROVOD_VERSION = "0.28.1"


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()  # the parameter has no default

POSITIONAL_OR_KEYWORD = "POSITIONAL_OR_KEYWORD"
VAR_POSITIONAL = "VAR_POSITIONAL"
KEYWORD_ONLY = "KEYWORD_ONLY"
VAR_KEYWORD = "VAR_KEYWORD"


@dataclass(frozen=True)
class Ref:
    """A default that is one of the API's own objects (``global_process_set``, ``Compression.none``,
    ``Average``): gpucomm's default must be gpucomm's object at ``path`` (in ``gpucomm.torch``), and
    equal ``value`` when Horovod's object is plain data."""

    path: str
    value: Any = REQUIRED


@dataclass(frozen=True)
class P:
    """One parameter."""

    name: str
    default: Any = REQUIRED
    kind: str = POSITIONAL_OR_KEYWORD


@dataclass(frozen=True)
class Function:
    source: str  # the Horovod module that defines it
    params: tuple[P, ...]


@dataclass(frozen=True)
class Class:
    source: str
    init: tuple[P, ...] | None  # constructor parameters (without self); None: not called by users
    methods: dict[str, tuple[P, ...]] = field(default_factory=dict)  # without self
    base: str | None = None  # "module:qualname" of a class it must subclass
    attributes: tuple[str, ...] = ()  # class or instance attributes users read


@dataclass(frozen=True)
class Constant:
    source: str
    value: Any


@dataclass(frozen=True)
class Module:
    """A submodule exported as a name (``hvd.elastic``): its own names."""

    source: str
    names: dict[str, Any]


GPS = Ref("global_process_set")
NO_COMPRESSION = Ref("Compression.none")
AVERAGE = Ref("Average", 0)


def _f(source: str, *params: P) -> Function:
    return Function(source, tuple(params))


def _basic(name: str) -> tuple[str, Function]:
    return name, _f("horovod.common.basics (HorovodBasics, bound in horovod.torch.mpi_ops)")


_MPI = "horovod.torch.mpi_ops"
_ALLREDUCE = (P("average", None), P("name", None), P("op", None), P("prescale_factor", 1.0),
              P("postscale_factor", 1.0), P("process_set", GPS))
_ALLREDUCE_C = (P("average", None), P("name", None), P("compression", NO_COMPRESSION), P("op", None),
                P("prescale_factor", 1.0), P("postscale_factor", 1.0), P("process_set", GPS))
_RS = (P("name", None), P("op", AVERAGE), P("process_set", GPS), P("prescale_factor", 1.0),
       P("postscale_factor", 1.0))
_RS_C = (P("name", None), P("compression", NO_COMPRESSION), P("op", AVERAGE), P("process_set", GPS),
         P("prescale_factor", 1.0), P("postscale_factor", 1.0))
_COMPRESSOR = {"compress": (P("tensor"),), "decompress": (P("tensor"), P("ctx"))}

HOROVOD_TORCH: dict[str, Any] = dict([
    # lifecycle and queries (HorovodBasics)
    ("init", _f("horovod.common.basics (HorovodBasics.init, via horovod.torch.mpi_ops.init)",
                P("comm", None), P("process_sets", None))),
    ("shutdown", _f("horovod.common.basics (HorovodBasics.shutdown, via horovod.torch.mpi_ops.shutdown)")),
    _basic("is_initialized"),
    ("start_timeline", _f("horovod.common.basics (HorovodBasics, bound in horovod.torch.mpi_ops)",
                          P("file_path"), P("mark_cycles", False))),
    _basic("stop_timeline"),
    _basic("size"), _basic("local_size"), _basic("cross_size"),
    _basic("rank"), _basic("local_rank"), _basic("cross_rank"),
    _basic("mpi_threads_supported"), _basic("mpi_enabled"), _basic("mpi_built"),
    _basic("gloo_enabled"), _basic("gloo_built"),
    _basic("nccl_built"), _basic("ddl_built"), _basic("ccl_built"), _basic("cuda_built"), _basic("rocm_built"),
    # reduction ops
    ("Average", Constant(_MPI, 0)), ("Sum", Constant(_MPI, 1)), ("Adasum", Constant(_MPI, 2)),
    ("Min", Constant(_MPI, 3)), ("Max", Constant(_MPI, 4)), ("Product", Constant(_MPI, 5)),
    # allreduce family
    ("allreduce", _f(_MPI, P("tensor"), *_ALLREDUCE_C)),
    ("allreduce_async", _f(_MPI, P("tensor"), *_ALLREDUCE)),
    ("allreduce_", _f(_MPI, P("tensor"), *_ALLREDUCE)),
    ("allreduce_async_", _f(_MPI, P("tensor"), *_ALLREDUCE)),
    ("grouped_allreduce", _f(_MPI, P("tensors"), *_ALLREDUCE_C)),
    ("grouped_allreduce_async", _f(_MPI, P("tensors"), *_ALLREDUCE)),
    ("grouped_allreduce_", _f(_MPI, P("tensors"), *_ALLREDUCE)),
    ("grouped_allreduce_async_", _f(_MPI, P("tensors"), *_ALLREDUCE)),
    ("sparse_allreduce_async", _f(_MPI, P("tensor"), P("name"), P("op"), P("process_set", GPS))),
    # allgather
    ("allgather", _f(_MPI, P("tensor"), P("name", None), P("process_set", GPS))),
    ("allgather_async", _f(_MPI, P("tensor"), P("name", None), P("process_set", GPS))),
    ("grouped_allgather", _f(_MPI, P("tensors"), P("name", None), P("process_set", GPS))),
    ("grouped_allgather_async", _f(_MPI, P("tensors"), P("name", None), P("process_set", GPS))),
    # broadcast
    ("broadcast", _f(_MPI, P("tensor"), P("root_rank"), P("name", None), P("process_set", GPS))),
    ("broadcast_async", _f(_MPI, P("tensor"), P("root_rank"), P("name", None), P("process_set", GPS))),
    ("broadcast_", _f(_MPI, P("tensor"), P("root_rank"), P("name", None), P("process_set", GPS))),
    ("broadcast_async_", _f(_MPI, P("tensor"), P("root_rank"), P("name", None), P("process_set", GPS))),
    # alltoall
    ("alltoall", _f(_MPI, P("tensor"), P("splits", None), P("name", None), P("process_set", GPS))),
    ("alltoall_async", _f(_MPI, P("tensor"), P("splits", None), P("name", None), P("process_set", GPS))),
    # reducescatter (note: op defaults to Average and process_set comes before the scale factors)
    ("reducescatter", _f(_MPI, P("tensor"), *_RS_C)),
    ("reducescatter_async", _f(_MPI, P("tensor"), *_RS)),
    ("grouped_reducescatter", _f(_MPI, P("tensors"), *_RS_C)),
    ("grouped_reducescatter_async", _f(_MPI, P("tensors"), *_RS)),
    # control
    ("join", _f(_MPI, P("device", -1))),
    ("barrier", _f(_MPI, P("process_set", GPS))),
    ("poll", _f(_MPI, P("handle"))),
    ("synchronize", _f(_MPI, P("handle"))),
    # process sets (horovod/common/process_sets.py, re-exported through mpi_ops)
    ("ProcessSet", Class("horovod.common.process_sets", (P("ranks_or_comm"),),
                         {"size": (), "rank": (), "included": ()},
                         attributes=("ranks", "process_set_id", "mpi_comm"))),
    ("global_process_set", Constant("horovod.common.process_sets", Ref("global_process_set"))),
    ("add_process_set", _f("horovod.common.process_sets", P("process_set"))),
    ("remove_process_set", _f("horovod.common.process_sets", P("process_set"))),
    # errors
    ("HorovodInternalError", Class("horovod.common.exceptions", None, base="builtins:RuntimeError")),
    # functions.py
    ("broadcast_parameters", _f("horovod.torch.functions", P("params"), P("root_rank"))),
    ("broadcast_optimizer_state", _f("horovod.torch.functions", P("optimizer"), P("root_rank"), P("model", None))),
    ("broadcast_object", _f("horovod.torch.functions", P("obj"), P("root_rank", 0), P("name", None),
                            P("process_set", GPS))),
    ("allgather_object", _f("horovod.torch.functions", P("obj"), P("name", None))),
    # optimizer.py (a factory function returning a dynamic subclass of the user's optimizer class)
    ("DistributedOptimizer", _f("horovod.torch.optimizer", P("optimizer"), P("named_parameters", None),
                                P("compression", NO_COMPRESSION), P("backward_passes_per_step", 1),
                                P("op", AVERAGE), P("gradient_predivide_factor", 1.0), P("num_groups", 0),
                                P("groups", None), P("sparse_as_dense", False), P("process_set", GPS))),
    # compression.py
    ("Compression", Class("horovod.torch.compression", None, attributes=("none", "fp16"))),
    ("Compression.none", Class("horovod.torch.compression (NoneCompressor)", None, dict(_COMPRESSOR))),
    ("Compression.fp16", Class("horovod.torch.compression (FP16Compressor)", None, dict(_COMPRESSOR))),
    # sync_batch_norm.py
    ("SyncBatchNorm", Class("horovod.torch.sync_batch_norm",
                            (P("num_features"), P("eps", 1e-5), P("momentum", 0.1), P("affine", True),
                             P("track_running_stats", True)),
                            {"forward": (P("input"),)}, base="torch.nn.modules.batchnorm:_BatchNorm")),
    # elastic/ (horovod.torch.elastic's __all__: run, TorchState, ElasticSampler; the init and
    # shutdown it imports for its reset are not in __all__, see NOT_API)
    ("elastic", Module("horovod.torch.elastic", {
        "run": _f("horovod.torch.elastic", P("func")),
        "TorchState": Class("horovod.torch.elastic.state (ObjectState, horovod.common.elastic.State)",
                            (P("model", None), P("optimizer", None), P("kwargs", kind=VAR_KEYWORD)),
                            {"commit": (), "save": (), "restore": (), "sync": (), "reset": (), "on_reset": (),
                             "check_host_updates": (), "register_reset_callbacks": (P("callbacks"),)}),
        "ElasticSampler": Class("horovod.torch.elastic.sampler", (P("dataset"), P("shuffle", True), P("seed", 0)),
                                {"set_epoch": (P("epoch"),), "record_batch": (P("batch_idx"), P("batch_size")),
                                 "load_state_dict": (P("state_dict"),), "state_dict": (), "reset": ()},
                                base="torch.utils.data:Sampler"),
    })),
])

# The object DistributedOptimizer returns: methods of optimizer.py's _DistributedOptimizer (the
# dynamic subclass, named like the user's optimizer class, adds them to it).
DISTRIBUTED_OPTIMIZER_METHODS: dict[str, tuple[P, ...]] = {
    "synchronize": (),
    "skip_synchronize": (),  # a context manager
    "set_backward_passes_per_step": (P("passes"),),
    "step": (P("closure", None),),
    "zero_grad": (),
    # Horovod's is (*args, **kwargs), forwarded to torch.optim.Optimizer.load_state_dict(state_dict)
    "load_state_dict": (P("state_dict"),),
}

# Defined in horovod.torch.mpi_ops, not re-exported by horovod.torch.
MPI_OPS_ONLY: dict[str, Any] = {
    "is_homogeneous": _f("horovod.common.basics (HorovodBasics, bound in horovod.torch.mpi_ops)"),
}

# Every public name of horovod/torch/mpi_ops.py at v0.28.1 (module-level defs, classes, assignments and
# imports; the modules ``torch`` and ``warnings`` left out): 74 names, the autograd classes and the four
# helpers it imports from horovod.common.util included.
MPI_OPS_NAMES = (
    "HorovodInternalError", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "check_installed_version", "get_average_backwards_compatibility_fun", "gpu_available", "num_rank_is_power_2",
    "Compression", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "shutdown", "init", "Average", "Sum",
    "Adasum", "Min", "Max", "Product", "is_homogeneous", "handle_average_backwards_compatibility",
    "allreduce_async", "HorovodAllreduce", "allreduce", "allreduce_async_", "allreduce_",
    "grouped_allreduce_async", "HorovodGroupedAllreduce", "grouped_allreduce", "grouped_allreduce_async_",
    "grouped_allreduce_", "sparse_allreduce_async", "allgather_async", "HorovodAllgather", "allgather",
    "grouped_allgather_async", "HorovodGroupedAllgather", "grouped_allgather", "broadcast_async",
    "HorovodBroadcast", "broadcast", "broadcast_async_", "broadcast_", "alltoall_async", "HorovodAlltoall",
    "alltoall", "reducescatter_async", "HorovodReducescatter", "reducescatter", "grouped_reducescatter_async",
    "HorovodGroupedReducescatter", "grouped_reducescatter", "poll", "synchronize", "join", "barrier")

# horovod.common.exceptions: elastic training scripts catch these.
COMMON_EXCEPTIONS: dict[str, Class] = {
    "HorovodInternalError": Class("horovod.common.exceptions", None, base="builtins:RuntimeError"),
    "HostsUpdatedInterrupt": Class("horovod.common.exceptions", (P("skip_sync"),), base="builtins:RuntimeError"),
}

# Submodules of horovod.torch that scripts import from directly (``from horovod.torch.mpi_ops import ...``).
SUBMODULES = ("compression", "functions", "mpi_ops", "optimizer", "sync_batch_norm", "elastic")

# Names in horovod.torch's namespace that are not API: import artifacts and the compiled extension.
NOT_API = {
    "check_extension": "imported helper (horovod.common.util) that checks the compiled extension",
    "mpi_lib_v2": "the compiled C++ extension module",
    "elastic.init": "mpi_ops.init imported into horovod.torch.elastic for its reset, not in its __all__",
    "elastic.shutdown": "mpi_ops.shutdown imported into horovod.torch.elastic for its reset, not in its __all__",
}

__all__ = ["AVERAGE", "COMMON_EXCEPTIONS", "Class", "Constant", "DISTRIBUTED_OPTIMIZER_METHODS", "Function", "GPS",
           "HOROVOD_TORCH", "HOROVOD_VERSION", "KEYWORD_ONLY", "MPI_OPS_NAMES", "MPI_OPS_ONLY", "Module", "NOT_API", "NO_COMPRESSION",
           "P", "POSITIONAL_OR_KEYWORD", "REQUIRED", "Ref", "SUBMODULES", "VAR_KEYWORD", "VAR_POSITIONAL"]
