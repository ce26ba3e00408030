"""Whether the launcher changed the job's membership since this round began (elastic mode)."""

from __future__ import annotations

import os
from typing import Mapping

from ..errors import HostsUpdatedInterrupt


def elastic_mode(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by ``gpucomm-run`` in elastic mode (``env``: default this process's)."""
    env = os.environ if env is None else env
    return env.get("GPUCOMM_ELASTIC", env.get("HOROVOD_ELASTIC", "")) == "1"


def check_host_updates() -> None:
    """Raise ``HostsUpdatedInterrupt`` on every rank alike when the launcher has published a newer
    round; a no-op outside elastic mode. In elastic mode a collective (rank 0 reads the store and
    broadcasts what it saw), so every rank must call it at the same point, as ``state.commit()`` does."""
    if not elastic_mode():
        return
    import torch  # noqa: PLC0415 - elastic workers run torch anyway

    from .. import runtime  # noqa: PLC0415
    from ..torch.mpi_ops import broadcast_  # noqa: PLC0415
    from .worker import current_round, newest_round  # noqa: PLC0415

    job = runtime.current()
    seen = torch.zeros(2, dtype=torch.int64)
    if job.world.rank == 0:
        newest, hosts_added = newest_round(job.client, job.world.run_id)
        seen[0], seen[1] = newest, int(hosts_added)
    broadcast_(seen, 0, name="elastic.check_host_updates")
    if int(seen[0]) > current_round():
        raise HostsUpdatedInterrupt(skip_sync=not bool(seen[1]))


__all__ = ["check_host_updates", "elastic_mode"]
