"""Public names of a package imported on first use (PEP 562's module `__getattr__`).

`import hybridlm` would otherwise import PyTorch (about 220 MB resident) for commands that never
touch a model: `hybridlm report`, `hybridlm trace show`, `--help`. A package lists where each of
its names lives; the name's module is imported the first time the name is read, and the name is
then an ordinary attribute of the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, homes: dict[str, tuple[str, ...]],
            public: list[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names are `homes`: module → names (a name `a as b`
    is module's `a` published as `b`); `public`, the package's `__all__`, must list the same names."""
    where: dict[str, tuple[str, str]] = {}
    for module, names in homes.items():
        for entry in names:
            own, _, alias = entry.partition(" as ")
            where[alias or own] = (module, own)
    if set(where) != set(public):
        raise ImportError(f"{package}: __all__ and the names it imports differ in {sorted(set(where) ^ set(public))}")

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, own = where[name]
        value = getattr(importlib.import_module(module), own)
        vars(importlib.import_module(package))[name] = value  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *where})

    return __getattr__, __dir__
