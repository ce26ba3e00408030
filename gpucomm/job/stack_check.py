"""Every rank of a job runs the same gpucomm and the same torch release series.

Ranks started from different installs (a host whose virtual environment or image is older than the
others') exchange control messages, bucket layouts and Gloo frames that the others may read
differently: the job then fails far from the cause, or hangs. Each rank puts its versions in its
arrival record (``software_stack``); every rank reads every record (``check_same_stack``), so all
raise alike at ``init()``, naming which ranks and hosts run what. One gpucomm version from different
sources (checkouts or images built at different commits, a file edited on one host) counts as a
difference too: the wire may change between commits (``gpucomm.source_digest``). A rank whose
sources cannot be read is compared by version only. Ranks with a GPU also put the version of the NCCL
that CuPy loads (``gpu_stack``): NCCL refuses to connect ranks of different versions, down to the patch
(``ncclInvalidUsage`` at the first GPU collective, naming no host), so they are compared exactly, among the
ranks that report one. A different Python minor version
only gets a warning: nothing gpucomm sends depends on it (the pickle protocol is the same from 3.8
on), though objects of the user's own that ranks exchange may.
"""

from __future__ import annotations

import logging
import platform
from typing import Any, Callable, Sequence

from .. import __version__
from ..backends.nccl import nccl_version, version_text
from ..errors import GpucommError, RoundReplaced
from ..source_digest import source_digest

__all__ = ["check_same_stack", "gpu_stack", "software_stack"]

log = logging.getLogger("gpucomm")


def software_stack() -> dict[str, str]:
    """This process's gpucomm version and sources' digest, torch and Python versions, for its arrival
    record."""
    import torch  # noqa: PLC0415 - the job needs torch anyway; kept out of the module's import

    return {"gpucomm": __version__, "gpucomm_sources": source_digest(), "torch": str(torch.__version__),
            "python": platform.python_version()}


NCCL_UNAVAILABLE = "none (CuPy's NCCL cannot be loaded)"


def gpu_stack() -> dict[str, str]:
    """(a rank pinned to a GPU) The NCCL version its collectives will use, for its arrival record's stack
    (loads CuPy's NCCL, as the rank's first GPU collective would)."""
    code = nccl_version()
    return {"nccl": version_text(code) if code else NCCL_UNAVAILABLE}


def _series(version: str, parts: int) -> str:
    """The first ``parts`` numbers of a version ("2.13.0+cpu" -> "2.13" for 2): a build's local tag
    (``+cpu``, ``+cu130``) and its patch release leave the wire alone."""
    return ".".join(version.split("+")[0].split(".")[:parts])


# what must agree: (the record's key, the part of its version that counts)
_MUST_AGREE: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("gpucomm", lambda v: v),
    ("torch", lambda v: _series(v, 2)),
)


def check_same_stack(records: Sequence[dict[str, Any]], rank: int) -> None:
    """Raise ``GpucommError`` when the ranks' arrival ``records`` differ in gpucomm's version or sources
    (among the ranks that report their digest) or in torch's release series (major.minor); when only
    Python's minor version differs, rank 0 (``rank`` is this one) logs a warning. A record without
    versions (a rank of an older gpucomm) counts as a version of its own.

    In an elastic round whose veterans (workers of an earlier round: ``record["veteran"]``) agree,
    the newcomers that differ from them are the odd ones: each of those raises that it leaves (its
    worker exits, and the launcher blacklists its host), the others ``RoundReplaced``, on which
    ``init()`` joins the next round, formed without them. Otherwise every rank raises alike."""
    problems = _differences(records)
    if problems:
        veterans = [rec for rec in records if rec.get("veteran")]
        if veterans and not _differences(veterans):
            _reject_newcomers(records, veterans, rank, problems)
        raise GpucommError(
            "the ranks of this job run different software versions (" + "; ".join(problems) + "). Ranks built "
            "from different installs exchange messages the others may read differently, so the job would fail "
            "far from the cause or hang. Likely cause: a host whose virtual environment, image or PYTHONPATH "
            f"differs from the others' (an older image, a stale venv, a node outside the shared filesystem). "
            f"{_fix(problems)}")
    python = _sides(records, "python", lambda v: _series(v, 2))
    if len(python) > 1 and rank == 0:
        log.warning("gpucomm: the ranks run different Python versions (%s). gpucomm works across them, but "
                    "objects of your own that ranks exchange (allgather_object, broadcast_object, elastic state) "
                    "must unpickle on every version.", _describe(python, records))


_FIX = ("Fix: install the same gpucomm and torch on every host, e.g. from one container image or one pinned "
        "requirements file; `gpucomm-run --check-build` on each host shows what it has.")
_NCCL_PROBLEM = "NCCL (CuPy's, on the ranks with a GPU)"
_NCCL_FIX = (" For NCCL: the same nvidia-nccl-cu12/-cu13 wheel on every host (`pip install nvidia-nccl-cu13==<version>`),"
             " or the same system libnccl; a LD_LIBRARY_PATH that puts another libnccl.so.2 first on one host counts "
             "too.")


def _fix(problems: list[str]) -> str:
    return _FIX + (_NCCL_FIX if any(p.startswith(_NCCL_PROBLEM) for p in problems) else "")


def _differences(records: Sequence[dict[str, Any]]) -> list[str]:
    """"key: who runs what" for each of ``_MUST_AGREE`` on which ``records`` differ, then for each gpucomm
    version that ranks share, its sources' digests where the ranks reporting one differ."""
    problems = []
    for key, counted in _MUST_AGREE:
        sides = _sides(records, key, counted)
        if len(sides) > 1:
            problems.append(f"{key}: {_describe(sides, records)}")
    for version, ranks in _sides(records, "gpucomm", str).items():
        reporting = [r for r in ranks if _sources(records[r])]
        sides = _sides([records[r] for r in reporting], "gpucomm_sources", str, ranks=reporting)
        if len(sides) > 1:
            problems.append(f"gpucomm {version} built from different sources, by their digests "
                            f"{_describe(sides, records)}: a checkout or image of another commit, or a .py file "
                            f"edited, added or left over on one host (a stale build/ folder in a wheel)")
    reporting = [r for r, rec in enumerate(records) if _nccl(rec) is not None]
    sides = _sides([records[r] for r in reporting], "nccl", str, ranks=reporting)
    if len(sides) > 1:
        problems.append(f"{_NCCL_PROBLEM}: {_describe(sides, records)}: NCCL connects only ranks of one version, "
                        f"down to the patch (its init fails with ncclInvalidUsage at the first GPU collective)")
    return problems


def _nccl(rec: dict[str, Any]) -> str | None:
    """The NCCL version a rank with a GPU will use (None: a rank without a GPU, or an older gpucomm)."""
    return (rec.get("stack") or {}).get("nccl")


def _sources(rec: dict[str, Any]) -> str | None:
    """The digest of the gpucomm sources a rank runs (None: an older gpucomm, or unreadable sources)."""
    return (rec.get("stack") or {}).get("gpucomm_sources")


def _reject_newcomers(records: Sequence[dict[str, Any]], veterans: Sequence[dict[str, Any]], rank: int,
                      problems: list[str]) -> None:
    """(an elastic round) Raise: on a newcomer whose install differs from the job's (its ``veterans``', which
    agree), that it leaves; on every other rank, that the round re-forms without those newcomers."""
    def counts(rec: dict[str, Any]) -> list[str]:
        return [counted(str((rec.get("stack") or {}).get(key))) for key, counted in _MUST_AGREE]

    theirs = counts(veterans[0])
    odd = {r for r, rec in enumerate(records) if counts(rec) != theirs}
    reported_by = (_sources, _nccl)  # what only some ranks report: compared where both do
    known = [next((reported(v) for v in veterans if reported(v) is not None), None) for reported in reported_by]
    for reported, their in zip(reported_by, known):  # first every newcomer that surely differs from the veterans
        odd |= {r for r, rec in enumerate(records) if their is not None and reported(rec) not in (None, their)}
    for reported, their in zip(reported_by, known):
        if their is None and len({reported(rec) for r, rec in enumerate(records) if r not in odd} - {None}) > 1:
            # no veteran reports it, and the other newcomers' differ: which is the job's is unknown, so each
            # newcomer reporting one leaves (else none would, and every rank, the veterans too, would raise)
            odd |= {r for r, rec in enumerate(records) if not rec.get("veteran") and reported(rec)}
    odd = sorted(odd)
    hosts = sorted({str(records[r].get("host")) for r in odd})
    where = f"{_ranks_text(odd)} (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})"
    if rank in odd:
        raise GpucommError(
            f"this worker (rank {rank}, host {records[rank].get('host')}) joined an elastic job whose workers run "
            f"another install ({'; '.join(problems)}), so it leaves the job: it would exchange messages the others "
            f"read differently. The launcher blacklists its host and the job goes on without it. {_fix(problems)}")
    raise RoundReplaced(  # init() joins the next round (a newcomer too: it keeps its host)
        f"{where} joined this elastic job with another install ({'; '.join(problems)}); they leave, and the job "
        f"re-forms without them (the launcher blacklists their hosts). {_fix(problems)}")


def _sides(records: Sequence[dict[str, Any]], key: str, counted: Callable[[str], str],
           ranks: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Which ranks report which version of ``key`` (as ``counted``), in rank order; ``ranks``: the ranks
    of ``records`` when they are not all the job's."""
    sides: dict[str, list[int]] = {}
    for r, rec in zip(range(len(records)) if ranks is None else ranks, records):
        version = (rec.get("stack") or {}).get(key)
        sides.setdefault("unknown (an older gpucomm)" if version is None else counted(str(version)), []).append(r)
    return sides


def _describe(sides: dict[str, list[int]], records: Sequence[dict[str, Any]]) -> str:
    """"2.13 on ranks 0-2 (host-a), 2.1 on rank 3 (host-b)"."""
    parts = []
    for version, ranks in sides.items():
        hosts = sorted({str(records[r].get("host")) for r in ranks})
        shown = ", ".join(hosts[:3]) + (f", +{len(hosts) - 3} more" if len(hosts) > 3 else "")
        parts.append(f"{version} on {_ranks_text(ranks)} ({shown})")
    return ", ".join(parts)


def _ranks_text(ranks: list[int]) -> str:
    """"rank 3", "ranks 0-2", "ranks 0, 2, 5" (the first 8)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    more = f", +{len(ranks) - 8} more" if len(ranks) > 8 else ""
    return "ranks " + ", ".join(map(str, ranks[:8])) + more

