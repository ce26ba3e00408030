"""The signature checker of tests/test_api_parity.py, and its rank functions (module level, so the
rank pool can import them).

Compatibility rule, per Horovod parameter: gpucomm has a parameter of the same name, at the same
position, of the same kind, and with the same default (plain data compared by value; Horovod's own
objects, ``global_process_set``, ``Compression.none``, ``Average``, must be gpucomm's very objects).
A parameter Horovod requires may have a default in gpucomm (every Horovod call still works).
gpucomm's extra parameters come after Horovod's and have defaults.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from tests.horovod_torch_api import (DISTRIBUTED_OPTIMIZER_METHODS, REQUIRED, Class, Constant, Function, Module, P,
                                     Ref)

Resolve = Callable[[str], Any]


def resolver(root: Any) -> Resolve:
    """``path`` ("Compression.none") → the object under ``root`` (gpucomm.torch); raises
    AttributeError or ImportError when something on the way is missing."""
    def resolve(path: str) -> Any:
        obj = root
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj
    return resolve


def _same_plain_default(ours: Any, theirs: Any) -> bool:
    if (ours is None) != (theirs is None) or isinstance(ours, bool) != isinstance(theirs, bool):
        return False
    try:
        return bool(ours == theirs)
    except Exception:  # an object whose == is not a bool (a tensor): not plain data
        return False


def _default_problem(name: str, ours: Any, theirs: Any, resolve: Resolve) -> str | None:
    if theirs is REQUIRED:
        return None  # Horovod requires it; a gpucomm default keeps every Horovod call working
    if ours is inspect.Parameter.empty:
        return f"{name!r} has no default; Horovod's is {theirs!r}"
    if isinstance(theirs, Ref):
        try:
            target = resolve(theirs.path)
        except (AttributeError, ImportError) as e:
            return f"{name!r}: its default should be gpucomm's {theirs.path}, which is missing ({e})"
        if ours is not target:
            return f"{name!r} defaults to {ours!r}, not gpucomm's {theirs.path} object"
        if theirs.value is not REQUIRED and not _same_plain_default(ours, theirs.value):
            return f"{name!r} defaults to {ours!r}, which is not Horovod's value {theirs.value!r}"
        return None
    if not _same_plain_default(ours, theirs):
        return f"{name!r} defaults to {ours!r}; Horovod's default is {theirs!r}"
    return None


def param_problems(expected: tuple[P, ...], sig: inspect.Signature, resolve: Resolve) -> list[str]:
    """What breaks Horovod calls when ``sig`` stands in for Horovod's ``expected`` parameters."""
    got = list(sig.parameters.values())
    index = {p.name: i for i, p in enumerate(got)}
    problems = []
    for i, hp in enumerate(expected):
        if hp.name not in index:
            problems.append(f"parameter {hp.name!r} (Horovod's position {i}) is missing")
            continue
        gp = got[index[hp.name]]
        if index[hp.name] != i and hp.kind in ("POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL"):
            problems.append(f"parameter {hp.name!r} is at position {index[hp.name]}; Horovod's is {i}")
        if gp.kind.name != hp.kind:
            problems.append(f"parameter {hp.name!r} is {gp.kind.name}; Horovod's is {hp.kind}")
        problem = _default_problem(hp.name, gp.default, hp.default, resolve)
        if problem:
            problems.append(problem)
    theirs = {hp.name for hp in expected}
    for i, gp in enumerate(got):
        if gp.name in theirs or gp.kind in (gp.VAR_POSITIONAL, gp.VAR_KEYWORD):
            continue
        if i < len(expected):
            problems.append(f"extra parameter {gp.name!r} at position {i} comes before Horovod's parameters end")
        if gp.default is inspect.Parameter.empty:
            problems.append(f"extra parameter {gp.name!r} is required (Horovod calls do not pass it)")
    return problems


def method_signature(cls: type, name: str) -> inspect.Signature:
    """A method's signature as callers see it (without self or cls)."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, staticmethod):
        return inspect.signature(raw.__func__)
    if isinstance(raw, classmethod):
        return inspect.signature(getattr(cls, name))
    sig = inspect.signature(raw)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _load(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def spec_problems(label: str, spec: Any, resolve: Resolve, instances: dict[str, Callable[[], Any]]) -> list[str]:
    """Everything about gpucomm's ``label`` that differs from Horovod's ``spec`` ([] = compatible).
    ``instances``: how to make an instance of a class, to read instance attributes."""
    try:
        obj = resolve(label)
    except (AttributeError, ImportError) as e:
        return [f"missing ({type(e).__name__}: {e})"]
    if isinstance(spec, Function):
        if not callable(obj):
            return [f"is {obj!r}, not callable"]
        try:
            return param_problems(spec.params, inspect.signature(obj), resolve)
        except (TypeError, ValueError) as e:
            return [f"has no readable signature ({e})"]
    if isinstance(spec, Constant):
        if isinstance(spec.value, Ref):
            return [] if obj is resolve(spec.value.path) else [f"is not gpucomm's {spec.value.path}"]
        try:
            same = obj == spec.value and int(obj) == spec.value and hash(obj) == hash(spec.value)
        except (TypeError, ValueError):
            same = False
        return [] if same else [f"is {obj!r}; Horovod's value is {spec.value!r}"]
    if isinstance(spec, Module):
        return [] if inspect.ismodule(obj) else [f"is {obj!r}, not a module"]
    assert isinstance(spec, Class), spec
    problems = []
    if not isinstance(obj, type):
        return [f"is {obj!r}, not a class"]
    if spec.base is not None:
        base = _load(spec.base)
        if not issubclass(obj, base):
            problems.append(f"does not subclass {spec.base.replace(':', '.')}")
    if spec.init is not None:
        problems += [f"constructor: {p}" for p in param_problems(spec.init, inspect.signature(obj), resolve)]
    for method, params in spec.methods.items():
        if not callable(getattr(obj, method, None)):
            problems.append(f"method {method}() is missing")
            continue
        problems += [f"{method}(): {p}" for p in param_problems(params, method_signature(obj, method), resolve)]
    instance = None
    for attribute in spec.attributes:
        if hasattr(obj, attribute):
            continue
        if instance is None and label in instances:
            instance = instances[label]()
        if instance is None or not hasattr(instance, attribute):
            problems.append(f"attribute {attribute!r} is missing")
    return problems


# ============================================================================================
# rank functions


def distributed_optimizer_and_process_sets() -> dict:
    """What Horovod users call on live objects: ``ProcessSet`` queries after ``init``, and the
    methods of the optimizer ``DistributedOptimizer`` returns, on members and non-members of its
    process set (rank 0 alone is in ``first``)."""
    import torch

    import gpucomm.torch as hvd

    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first])
    rank, size = hvd.rank(), hvd.size()
    gps = hvd.global_process_set
    sets = {"global": [gps.process_set_id, gps.ranks, gps.size(), gps.rank(), gps.included()],
            "first": [first.process_set_id is not None and first.process_set_id != 0, first.ranks, first.size(),
                      first.included()]}
    expected_sets = {"global": [0, list(range(size)), size, rank, True],
                     "first": [True, [0], 1, rank == 0]}
    resolve = resolver(hvd)
    optimizers = {}
    for label, kwargs in (("global", {}), ("first-set", {"process_set": first})):
        model = torch.nn.Linear(3, 2)
        try:
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **kwargs)
        except Exception as e:
            optimizers[label] = [f"DistributedOptimizer(...) raised {type(e).__name__}: {e}"]
            continue
        problems = []
        if not isinstance(opt, torch.optim.SGD) or type(opt).__name__ != "SGD":
            problems.append(f"is a {type(opt).__name__}, not a subclass of the wrapped SGD named 'SGD'")
        for method, params in DISTRIBUTED_OPTIMIZER_METHODS.items():
            bound = getattr(opt, method, None)
            if not callable(bound):
                problems.append(f"method {method}() is missing")
                continue
            problems += [f"{method}(): {p}" for p in param_problems(params, inspect.signature(bound), resolve)]
        optimizers[label] = problems
    hvd.shutdown()
    return {"sets": sets, "expected_sets": expected_sets, "optimizers": optimizers}
