"""Every public name of ``horovod.torch`` 0.28.1 (tests/horovod_torch_api.py) exists in
``gpucomm.torch`` with a compatible signature, so a script that changes only its import keeps
working. The rule is in tests/ranks/api_parity_scenarios.py: same parameter names, positions, kinds and
defaults; gpucomm's extra parameters last, with defaults.

What gpucomm refuses on purpose is listed in ``NOT_OFFERED`` with the reason; using it raises
NotImplementedError or ValueError with a message saying what to do instead, never AttributeError.
No ``horovod.torch`` *name* is left out on purpose; what gpucomm refuses are some *uses* of names
it has (an MPI communicator where Horovod accepts one). An entry whose label is a Horovod name
replaces that name's signature check.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import pytest

import gpucomm.torch as hvd
from tests.ranks import api_parity_scenarios as scenarios
from tests.harness import run_ranks
from tests.horovod_torch_api import (AVERAGE, COMMON_EXCEPTIONS, GPS, HOROVOD_TORCH, HOROVOD_VERSION, MPI_OPS_ONLY,
                                     NO_COMPRESSION, SUBMODULES, Module, P)


class _FakeMpiComm:
    """Quacks like an mpi4py communicator (what ProcessSet and init(comm=...) would receive)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


NOT_OFFERED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "init(comm=...)": (
        "gpucomm joins the job its launcher described and has no MPI communicator to take a sub-world of: start "
        "exactly the processes that should take part (or use process sets).",
        lambda hvd: hvd.init(comm=[0])),
    "ProcessSet(<mpi4py communicator>)": (
        "a gpucomm process set is built from its global ranks, also on MPI; an mpi4py communicator is refused.",
        lambda hvd: hvd.ProcessSet(_FakeMpiComm())),
}

# Instances to read instance attributes from (Horovod sets them in __init__).
INSTANCES: dict[str, Callable[[], Any]] = {"ProcessSet": lambda: hvd.ProcessSet([0])}


def _items() -> dict[str, Any]:
    """label (a path under gpucomm.torch) → Horovod's spec, for every name checked."""
    items: dict[str, Any] = {}
    for name, spec in HOROVOD_TORCH.items():
        items[name] = spec
        if isinstance(spec, Module):
            items.update({f"{name}.{sub}": subspec for sub, subspec in spec.names.items()})
    items.update(MPI_OPS_ONLY)
    items.update({name: spec for name, spec in COMMON_EXCEPTIONS.items() if name not in items})
    return items


ITEMS = _items()
CHECKED = {label: spec for label, spec in ITEMS.items() if label not in NOT_OFFERED}


def _problems(label: str) -> list[str]:
    return scenarios.spec_problems(label, CHECKED[label], scenarios.resolver(hvd), INSTANCES)


def test_every_horovod_name_is_offered_compatibly():
    """All at once: one report listing every missing or mismatched name."""
    report = {label: _problems(label) for label in CHECKED}
    broken = {label: problems for label, problems in report.items() if problems}
    lines = [f"  {label}: " + "; ".join(problems) for label, problems in sorted(broken.items())]
    assert not broken, (f"{len(broken)} of {len(CHECKED)} horovod.torch {HOROVOD_VERSION} names are missing or "
                        f"incompatible in gpucomm.torch:\n" + "\n".join(lines))


@pytest.mark.parametrize("label", sorted(CHECKED))
def test_horovod_name(label):
    problems = _problems(label)
    assert not problems, f"gpucomm.torch.{label}: " + "; ".join(problems)


@pytest.mark.parametrize("label", sorted(NOT_OFFERED))
def test_refused_use_says_what_to_do_instead(label):
    reason, use = NOT_OFFERED[label]
    assert reason
    try:
        use(hvd)
    except (NotImplementedError, ValueError) as e:
        assert len(str(e)) >= 40, f"{label} raised {type(e).__name__} with too short a message: {e!r}"
    except AttributeError as e:
        pytest.fail(f"{label} raised AttributeError ({e}); it must say what to use instead")
    else:
        if hvd.is_initialized():
            hvd.shutdown()
        pytest.fail(f"{label} did not raise; NOT_OFFERED says gpucomm refuses it ({reason})")


@pytest.mark.parametrize("submodule", SUBMODULES)
def test_horovod_submodules_are_importable(submodule):
    """Scripts import from them directly (``from horovod.torch.mpi_ops import allreduce_async_``)."""
    importlib.import_module(f"gpucomm.torch.{submodule}")


@pytest.mark.parametrize("size", [2, 3])
def test_live_objects_match_horovod(size):
    """ProcessSet queries after init, and the methods of the optimizer DistributedOptimizer returns,
    on ranks inside and outside its process set."""
    results = run_ranks(scenarios.distributed_optimizer_and_process_sets, size, timeout=120)
    for rank, result in enumerate(results):
        assert result["sets"] == result["expected_sets"], f"rank {rank}: {result['sets']}"
        broken = {label: problems for label, problems in result["optimizers"].items() if problems}
        assert not broken, f"rank {rank}: DistributedOptimizer objects differ from Horovod's: {broken}"


def test_checker_catches_each_kind_of_mismatch():
    """The rule itself: each way of breaking a Horovod call is reported."""
    resolve = scenarios.resolver(hvd)
    horovod = (P("tensor"), P("name", None), P("op", AVERAGE), P("process_set", GPS), P("compression", NO_COMPRESSION))

    def problems(fn) -> list[str]:
        return scenarios.param_problems(horovod, inspect.signature(fn), resolve)

    def same(tensor, name=None, op=hvd.Average, process_set=hvd.global_process_set,
             compression=hvd.Compression.none, extra=3):
        pass

    def moved(tensor, op=hvd.Average, name=None, process_set=hvd.global_process_set,
              compression=hvd.Compression.none):
        pass

    def keyword_only(tensor, name=None, *, op=hvd.Average, process_set=hvd.global_process_set,
                     compression=hvd.Compression.none):
        pass

    def other_set(tensor, name=None, op=hvd.Average, process_set=hvd.ProcessSet([0]),
                  compression=hvd.Compression.none):
        pass

    def wrong_value(tensor, name="x", op=hvd.Sum, process_set=hvd.global_process_set,
                    compression=hvd.Compression.fp16):
        pass

    def missing_and_required_extra(tensor, name=None, op=hvd.Average, process_set=hvd.global_process_set, extra=None,
                                   more=None, *, needed):
        pass

    assert problems(same) == []
    assert any("position" in p for p in problems(moved))
    assert sum("KEYWORD_ONLY" in p for p in problems(keyword_only)) == 3
    assert any("not gpucomm's global_process_set" in p for p in problems(other_set))
    assert len(problems(wrong_value)) == 3
    text = "; ".join(problems(missing_and_required_extra))
    assert "'compression'" in text and "missing" in text and "'needed' is required" in text
