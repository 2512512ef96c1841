"""The DeepSpeed range CI tests (.ci/run: the numerical core on the oldest and the newest).

setup.py allows the next patch releases too (``>=TESTED_MIN,<NEXT_MINOR``; tests/unit/test_patches.py checks
that the two agree): pip must not refuse dsclip beside a DeepSpeed 0.19.x that CI has not run yet, since
every engine patch checks its own targets' sources and falls back alone. Such a release gets one start-up
line (:func:`outside_tested_range`) and the patches whose fingerprints match."""

from __future__ import annotations


def deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "not installed"


TESTED_MIN = "0.19.2"  # coalesce_grad_reduction (PR #7992): the gradient cache's exact accumulation
TESTED_MAX = "0.19.8"
NEXT_MINOR = "0.20"  # setup.py's exclusive bound: a minor release may move what the patches' guards cannot see


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def outside_tested_range(version: str | None = None) -> str | None:
    """One line when the installed DeepSpeed is outside the tested range, else None. The run goes on: each
    patch still checks its own targets (dsclip/engine/patches/__init__.py)."""
    version = version or deepspeed_version()
    if version == "not installed" or _key(TESTED_MIN) <= _key(version) <= _key(TESTED_MAX):
        return None
    return (
        f"dsclip: DeepSpeed {version} is outside the range dsclip is tested on ({TESTED_MIN} to {TESTED_MAX}, "
        f"setup.py); going on with the engine patches whose checks pass"
    )


def at_least(minimum: str, version: str | None = None) -> bool:
    version = version or deepspeed_version()
    return version == "not installed" or _key(version) >= _key(minimum)


def has_coalesced_reduction(version: str | None = None) -> bool:
    version = version or deepspeed_version()
    return version == "not installed" or _key(version) >= _key(TESTED_MIN)
