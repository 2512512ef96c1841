"""What every run-config section is made of: ``opt`` (a dataclass field carrying its --help) and ConfigError.

Each section is defined next to the component that consumes it (``dsclip.data.DataConfig``,
``dsclip.losses.LossArgs``, ...); ``dsclip.config`` assembles them into the run config. This module
sits below all of them so that a section never has to import the assembly.
"""

from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it as one line and exits non-zero."""


def opt(default, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = (), **kw):
    """A dataclass field carrying its --help text (and optional choices, and other flag spellings)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if aliases:
        meta["aliases"] = aliases
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
