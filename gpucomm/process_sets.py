"""Process sets: collectives among a subset of the job's ranks (Horovod's ``ProcessSet`` API).

``ProcessSet`` is the user's handle (importable without torch); the data plane's view of a
registered set is ``gpucomm.dataplane.groups.Group``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .settings import DYNAMIC_PROCESS_SETS


class ProcessSet:
    """A subset of the job's ranks. Registered at ``init(process_sets=[...])`` or with
    ``add_process_set``; until then ``process_set_id`` is None."""

    mpi_comm: Any = None  # Horovod's attribute, for sets built from an MPI communicator: never, in gpucomm

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if hasattr(ranks_or_comm, "Get_rank"):
            raise NotImplementedError("ProcessSet(mpi4py communicator) is not supported: a gpucomm process set is "
                                      "built from its global ranks (also when its CPU collectives run on MPI). "
                                      "Pass the list of ranks instead, e.g. comm.allgather(hvd.rank()).")
        ranks = list(ranks_or_comm)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks: list[int] = sorted(ranks)
        self.process_set_id: int | None = None
        self._my_rank: int | None = None  # this process's global rank, once registered

    def register(self, set_id: int, ranks: Sequence[int], my_rank: int) -> None:
        """The job registered this set as ``set_id`` (called by ``init``/``add_process_set``, not by scripts)."""
        self.process_set_id, self.ranks, self._my_rank = set_id, sorted(ranks), my_rank

    def unregister(self) -> None:
        """The set was removed from the job (``remove_process_set``) or the job ended."""
        self.process_set_id, self._my_rank = None, None

    def size(self) -> int | None:
        """Number of ranks in the set (None until registered)."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's index in the set; None until registered or when not a member."""
        if self.process_set_id is None or self._my_rank not in self.ranks:
            return None
        return self.ranks.index(self._my_rank)

    def included(self) -> bool | None:
        """Whether this process is a member (None until registered)."""
        return None if self.process_set_id is None else self._my_rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProcessSet) and self.ranks == other.ranks
                and self.process_set_id == other.process_set_id)

    def __hash__(self) -> int:
        return hash((tuple(self.ranks), self.process_set_id))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])  # id 0 once gpucomm is initialized: every rank


def check_members(ranks: Sequence[int], size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``ranks`` are distinct ranks of a ``size``-rank job."""
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"{what}: ranks {bad} are not ranks of this job (0..{size - 1}).")
    if not ranks:
        raise ValueError(f"{what}: a process set needs at least one rank.")


def init_sets(process_sets: Any, size: int, env: Mapping[str, str]) -> tuple[list[tuple[int, ...]], bool]:
    """What ``init(process_sets=...)`` registers (the ranks of sets 1, 2, ...), and whether
    ``add_process_set`` is allowed later (``"dynamic"``, or GPUCOMM_DYNAMIC_PROCESS_SETS=1)."""
    dynamic = DYNAMIC_PROCESS_SETS.read(env, False)
    if process_sets is None:
        return [], dynamic
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet (or rank lists), or "
                             f"the string 'dynamic'.")
        return [], True
    out: list[tuple[int, ...]] = []
    for ps in process_sets:
        ranks = tuple(sorted(getattr(ps, "ranks", ps)))
        check_members(ranks, size, "init(process_sets=...)")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"init(process_sets=...): the set {list(ranks)} lists a rank twice.")
        if ranks == tuple(range(size)) or ranks in out:
            raise ValueError(f"init(process_sets=...): the set {list(ranks)} is registered twice (the set of all "
                             f"ranks is always there as hvd.global_process_set).")
        out.append(ranks)
    return out, dynamic


__all__ = ["ProcessSet", "check_members", "global_process_set", "init_sets"]
