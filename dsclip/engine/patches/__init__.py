"""The seam: every change dsclip makes to DeepSpeed's (or torch's) internals, one module per change.

Why one place: a patched method that keeps its name but changes what it does upstream would make a run
silently diverge, so each change states what it was written against and checks it before it goes in,
the pattern onnxruntime's ``_ds_modifier.py`` uses for the same ZeRO-1/2 methods:

- ``verified``: the DeepSpeed releases its tests ran on (CI's version matrix, .ci/run);
- ``targets``: the DeepSpeed methods it replaces or whose behaviour it relies on, each with the source
  fingerprints (dsclip/engine/patches/fingerprint.py) of the verified releases. A missing attribute or an
  unknown fingerprint means no patch: DeepSpeed's own path runs, and one line in the log names the patch,
  the installed version and the method that differs;
- ``stages``: the ZeRO stages it is for; on other stages it is not considered at all (no line: the normal
  case, e.g. ZeRO-1/2 patches under ZeRO-3). The fingerprint check comes next, then
- ``applies(engine)``: whether this engine is the plain case the patch handles (world, offload, layout ...);
  where it is not, DeepSpeed's path runs without a line (nothing is wrong with the installed DeepSpeed).

``build_engine`` calls :func:`install_patches` right after ``deepspeed.initialize``; every patch is scoped to
that engine (instance attributes of the engine, its optimizer, its modules and their parameters). One
function DeepSpeed looks up as a module global, ZeRO-3's ``iter_params``, gets a dispatcher instead
(``zero3_params``): it answers for the modules an engine with that patch marked and hands every other module
to DeepSpeed's own function.
``--engine-patches`` (run config ``engine_patches``) selects them: ``all`` (default), ``none``, a comma list
of names, or ``all,-NAME`` to leave some out. The rank line and run_config.yaml list what is
active. Outside this package nothing touches a private DeepSpeed name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsclip.engine.patches import (
    grad_hooks,
    grad_norm,
    local_flush,
    overflow_check,
    universal_zero3,
    zero3_blocks,
    zero3_forward_flags,
    zero3_gather,
    zero3_hook_fns,
    zero3_local_flush,
    zero3_local_persist,
    zero3_norm,
    zero3_params,
    zero3_release,
    zero3_step_views,
    zero3_traces,
)
from dsclip.engine.patches.fingerprint import deepspeed_version, mismatched_target

ALL, NONE = "all", "none"


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str  # what it changes, one line (docs/deepspeed-notes.md has the measurements)
    verified: tuple[str, ...]
    targets: dict[str, frozenset[str]]  # "module:Class.method" -> fingerprints of the verified releases
    stages: tuple[int, ...]
    applies: Callable[[object], bool]
    install: Callable[[object], None]


PATCHES: tuple[Patch, ...] = tuple(
    Patch(m.NAME, m.SUMMARY, m.VERIFIED, m.TARGETS, m.STAGES, m.applies, m.install)
    for m in (
        local_flush,
        overflow_check,
        grad_hooks,
        grad_norm,
        zero3_params,
        zero3_traces,
        zero3_gather,
        zero3_norm,
        zero3_step_views,
        zero3_release,
        zero3_hook_fns,
        zero3_blocks,
        zero3_forward_flags,  # after zero3_blocks, whose blocks it reads
        zero3_local_flush,
        zero3_local_persist,  # after zero3_gather, whose post-step it wraps
    )
)
# Patches that act later than build_engine, where the engine does what they repair (a universal load):
# selected and checked the same way, applied by the code that calls them.
LOAD_TIME = (universal_zero3,)
NAMES = tuple(p.name for p in PATCHES) + tuple(m.NAME for m in LOAD_TIME)


class PatchSelectionError(ValueError):
    pass


def parse_selection(spec: str) -> frozenset[str]:
    """``all`` | ``none`` | ``a,b`` | ``all,-a`` -> the set of patch names to try."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    chosen: set[str] = set()
    for item in items or [ALL]:
        name = item.lstrip("-")
        if item == ALL:
            chosen |= set(NAMES)
        elif item == NONE:
            chosen.clear()
        elif name not in NAMES:
            raise PatchSelectionError(
                f"--engine-patches: unknown patch {name!r}; known: {', '.join(NAMES)} (or 'all' / 'none')"
            )
        elif item.startswith("-"):
            chosen.discard(name)
        else:
            chosen.add(name)
    return frozenset(chosen)


@dataclass
class PatchReport:
    selected: frozenset[str] = frozenset()
    active: list[str] = field(default_factory=list)
    # name -> why DeepSpeed's own path runs instead (a failed check; not "does not apply")
    refused: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The rank line's part: ``patches local_flush,overflow_check`` (or ``patches none``)."""
        return "patches " + (",".join(self.active) or "none")


def check_patch(patch: Patch, version: str | None = None) -> str | None:
    """None when the installed DeepSpeed has every target with a known fingerprint, else the reason."""
    version = version or deepspeed_version()
    bad = mismatched_target(patch.targets)
    if bad is None:
        return None
    return (
        f"patch {patch.name} off: DeepSpeed {version}'s {bad} is not the one it was written against "
        f"(verified: DeepSpeed {', '.join(patch.verified)}); DeepSpeed's own path runs"
    )


def passes_check(name: str) -> bool:
    """Whether patch ``name``'s targets are the verified ones in the installed DeepSpeed."""
    targets = {p.name: p.targets for p in PATCHES} | {m.NAME: m.TARGETS for m in LOAD_TIME}
    return mismatched_target(targets[name]) is None


def install_patches(engine, selection: str | frozenset[str] = ALL, log: Callable[[str], None] = print) -> PatchReport:
    """Install every selected patch that applies to ``engine`` and passes its check; log each refusal."""
    chosen = parse_selection(selection) if isinstance(selection, str) else selection
    report = PatchReport(selected=chosen)
    stage = engine.zero_optimization_stage()
    for patch in PATCHES:
        if patch.name not in chosen or stage not in patch.stages:
            continue
        reason = check_patch(patch)
        if reason is not None:
            report.refused[patch.name] = reason
            log(f"[dsclip] {reason}")
            continue
        if not patch.applies(engine):
            continue
        patch.install(engine)
        report.active.append(patch.name)
    for module in LOAD_TIME:  # listed as active where they would act (they check again when they do)
        if module.NAME in chosen and stage in module.STAGES and mismatched_target(module.TARGETS) is None:
            report.active.append(module.NAME)
    engine.dsclip_patches = report  # what tests, bench/ and the run config read
    return report


def active_patches(engine) -> list[str]:
    report = getattr(engine, "dsclip_patches", None)
    return list(report.active) if report is not None else []
