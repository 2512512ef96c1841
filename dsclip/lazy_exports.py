"""Package exports loaded on first use (PEP 562), so that importing a package for its settings classes
(what every ``--help`` does) pulls no torch, timm or DeepSpeed. One implementation for every package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, table: Mapping[str, str], first: str | None = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``table`` maps an exported name to its submodule.
    ``first``: a submodule imported before any lazy name (dsclip.model: the towers, see there)."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if first is not None:
            importlib.import_module(f".{first}", package)
        value = getattr(importlib.import_module(f".{table[name]}", package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    return __getattr__
