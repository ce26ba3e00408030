"""``hvd.elastic``: training that survives ranks leaving and joining (Horovod's elastic API).

State objects keep the last good state in memory and hand it to new ranks; ``ElasticSampler``
re-shards the rest of an epoch when the job's size changes."""

from ...errors import CollectiveError as HorovodInternalError
from ...errors import HostsUpdatedInterrupt
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

from .run import run

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
