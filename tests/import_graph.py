"""The import graph of ``gpucomm/``, from the code's own import statements (ast, nothing imported):
which imports run up the layers, which modules import each other in a circle (in-function imports
counted), which imports take a private name from another module, and which imports sit inside
functions. ``tests/test_import_rules.py`` holds the package to the rules; run this module to print
the counts and every offending import:

    python -m tests.import_graph

Layers, bottom to top (DESIGN.md): bootstrap < backends, kernels < dataplane < control < job <
torch front; the runner stands beside (and imports no torch); the timeline, tuning and the package
root's small shared modules (errors, counters, settings, ...) are utilities below the job.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpucomm"

# the layer of each top-level part of the package (a module path's first component after gpucomm)
LAYERS = {
    "base": 0,  # gpucomm/<module>.py utilities shared by every layer (errors, counters, settings, ...)
    "bootstrap": 1,
    "backends": 2, "kernels": 2,
    "dataplane": 3,
    "control": 4, "tuning": 4,  # tuning plans fusion buckets (dataplane.fusion) for the front to use
    "job": 5, "elastic": 5,  # elastic/: main's worker side of the rounds (now job/elastic.py)
    "torch": 6, "scaling": 6,
    "timeline": 0,
    "runner": 6,
    "ray": 6,  # gpucomm.ray launches jobs on Ray: it stands beside the runner and reuses it
}
# package-root modules that belong to a layer above the utilities (runtime, startup: main's names)
ROOT_MODULE_LAYERS = {"job": "job", "runtime": "job", "startup": "job", "process_sets": "job", "failures": "job",
                      "communicator": "torch", "run": "job", "scaling": "scaling"}


@dataclass
class Import:
    source: str  # the importing module (dotted)
    target: str  # the imported module (dotted)
    names: list[str]  # names taken with ``from ... import``
    in_function: bool
    line: int


@dataclass
class AttributeRead:
    source: str  # the reading module
    target: str  # the gpucomm module whose private name is read
    name: str
    line: int


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    private_reads: list[AttributeRead] = field(default_factory=list)  # ``other_module._name``


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def part_of(module: str) -> str:
    """The layer key of a gpucomm module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    if len(parts) == 2 and parts[1] in ROOT_MODULE_LAYERS:
        return ROOT_MODULE_LAYERS[parts[1]]
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return "base"
    return parts[1]


def layer_of(module: str) -> int:
    return LAYERS.get(part_of(module), 0)


def _resolve(source: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def build() -> Graph:
    graph = Graph()
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        graph.modules[module_name(path)] = path
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        functions = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("gpucomm"):
                        graph.imports.append(Import(name, alias.name, [], id(node) in functions, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_package, node.level, node.module)
                if not target.startswith("gpucomm"):
                    continue
                names = [a.name for a in node.names]
                # ``from .pkg import module``: each name that is a module is an import of that module
                modules = [f"{target}.{n}" for n in names if f"{target}.{n}" in graph.modules]
                for m in modules:
                    graph.imports.append(Import(name, m, [], id(node) in functions, node.lineno))
                rest = [n for n in names if f"{target}.{n}" not in graph.modules]
                if rest or not modules:
                    graph.imports.append(Import(name, target, rest, id(node) in functions, node.lineno))
        graph.private_reads += _private_reads(name, is_package, tree, graph.modules)
    return graph


def _private_reads(name: str, is_package: bool, tree: ast.AST, modules: dict[str, Path]) -> list[AttributeRead]:
    """``alias._name`` where ``alias`` is bound to another gpucomm module by an import in ``name``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gpucomm") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != name):
            out.append(AttributeRead(name, aliases[node.value.id], node.attr, node.lineno))
    return out


def upward(graph: Graph) -> list[Import]:
    """Imports from a lower layer into a higher one (TYPE_CHECKING-only imports excepted: none here)."""
    return [i for i in graph.imports if i.target in graph.modules and layer_of(i.target) > layer_of(i.source)
            and part_of(i.source) != part_of(i.target)]


def private_names(graph: Graph) -> list[Import]:
    """``from other_module import _name`` (a module's own package ``__init__`` re-exporting is not excepted)."""
    return [i for i in graph.imports if i.source != i.target and any(n.startswith("_") and not n.startswith("__")
                                                                        for n in i.names)]


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (in-function imports counted; a
    package's ``__init__`` importing its own submodules is not an edge back)."""
    edges: dict[str, set[str]] = {m: set() for m in graph.modules}
    for i in graph.imports:
        if i.target in graph.modules and i.source != i.target:
            if i.target.startswith(i.source + ".") and graph.modules[i.source].name == "__init__.py":
                continue  # a package importing its own submodule
            edges[i.source].add(i.target)
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def in_function(graph: Graph) -> list[Import]:
    return [i for i in graph.imports if i.in_function]


def report() -> dict:
    graph = build()
    up, private, circles, inner = upward(graph), private_names(graph), cycles(graph), in_function(graph)
    return {"modules": len(graph.modules), "upward": up, "private": private, "cycles": circles,
            "in_function": inner, "private_reads": graph.private_reads}


def main() -> None:
    r = report()
    print(f"gpucomm import graph: {r['modules']} modules")
    print(f"upward imports: {len(r['upward'])}")
    for i in r["upward"]:
        print(f"  {i.source}:{i.line} -> {i.target} ({part_of(i.source)} -> {part_of(i.target)})")
    print(f"cycles: {len(r['cycles'])}")
    for c in r["cycles"]:
        print(f"  {len(c)} modules: {', '.join(c)}")
    names = sorted({n for i in r["private"] for n in i.names if n.startswith("_")})
    print(f"imports of private names from another module: {len(r['private'])} ({len(names)} names)")
    for i in r["private"]:
        print(f"  {i.source}:{i.line} <- {i.target}: {', '.join(n for n in i.names if n.startswith('_'))}")
    print(f"private names read from another module (module._name): {len(r['private_reads'])}")
    for a in r["private_reads"]:
        print(f"  {a.source}:{a.line} reads {a.target}.{a.name}")
    print(f"in-function imports of gpucomm modules: {len(r['in_function'])}")
    for i in r["in_function"]:
        print(f"  {i.source}:{i.line} -> {i.target}")


if __name__ == "__main__":
    main()
