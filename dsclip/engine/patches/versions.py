"""The DeepSpeed range CI tests (.ci/run: the numerical core on the oldest and the newest), which setup.py
declares (tests/unit/test_patches.py checks that the two agree)."""

from __future__ import annotations

from dsclip.engine.patches.fingerprint import deepspeed_version

TESTED_MIN = "0.19.2"  # coalesce_grad_reduction (PR #7992): the gradient cache's exact accumulation
TESTED_MAX = "0.19.8"


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
