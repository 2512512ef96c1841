"""Source fingerprints of the DeepSpeed methods a patch replaces or relies on: the seam's guard.

Beside the seam (dsclip/engine/patches/), not in it: it changes nothing in DeepSpeed, it only reads sources.

A fingerprint is the first 12 hex digits of the SHA-256 of the method's source, dedented (so moving a
method into another class level does not change it, editing one character does). A patch lists the
fingerprints of every release it was verified on (``python -m dsclip.engine.fingerprint`` prints
the installed release's), and installs only where the installed source is one of them.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Mapping

from dsclip.engine.versions import deepspeed_version


def resolve(target: str):
    """``"deepspeed.runtime.engine:DeepSpeedEngine.step"`` -> the function, or None when any part is missing."""
    module_name, _, qualname = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def unwrap(fn):
    """The function a decorator wraps: ``__wrapped__`` (functools.wraps), or the ``func`` a closure holds
    (DeepSpeed's ``instrument_w_nvtx`` wraps without functools.wraps, so every method it decorates would
    otherwise have the wrapper's source, and one fingerprint)."""
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            code = getattr(fn, "__code__", None)
            if code is not None and "func" in code.co_freevars and fn.__closure__:
                inner = fn.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            return fn
        fn = inner
    return fn


def fingerprint(fn) -> str | None:
    try:
        source = inspect.getsource(unwrap(fn))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(textwrap.dedent(source).encode()).hexdigest()[:12]


def mismatched_target(targets: Mapping[str, frozenset[str]]) -> str | None:
    """The first target that is missing or whose fingerprint is not a known one (named for the log), or None."""
    for target, known in targets.items():
        fn = resolve(target)
        if fn is None:
            return f"{target.partition(':')[2]} (missing)"
        if fingerprint(fn) not in known:
            return f"{target.partition(':')[2]} (source changed: {fingerprint(fn)})"
    return None


if __name__ == "__main__":  # what to paste into a patch's TARGETS after verifying it on a new release
    from dsclip.engine.patches import PATCHES

    print(f"DeepSpeed {deepspeed_version()}")
    for patch in PATCHES:
        for target in patch.targets:
            fn = resolve(target)
            print(f"{patch.name:16s} {target}: {None if fn is None else fingerprint(fn)}")
