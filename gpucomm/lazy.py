"""Names a package exports without importing them: each is loaded from its module on first use,
so importing the package stays light (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_names(package: str, names: Mapping[str, str], namespace: dict) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps an exported name to the submodule
    (relative to ``package``) that defines it, or a submodule's name to itself; the value is cached
    in ``namespace`` once loaded."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(f".{module}", package)
        value = loaded if module == name and not hasattr(loaded, name) else getattr(loaded, name)  # a submodule
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(names: Mapping[str, str], namespace: dict) -> Callable[[], list[str]]:
    """A module ``__dir__`` (PEP 562) that lists the lazily exported ``names`` before their first use
    too, beside what ``namespace`` already holds: tab completion and tools that discover an API by
    ``dir()`` see the whole package."""

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __dir__


__all__ = ["lazy_dir", "lazy_names"]
