"""The seam: every change dsclip makes to DeepSpeed's (or torch's) internals, one module per change.

Why one place: a patched method that keeps its name but changes what it does upstream would make a run
silently diverge, so each change states what it was written against and checks it before it goes in,
the pattern onnxruntime's ``_ds_modifier.py`` uses for the same ZeRO-1/2 methods:

- ``verified``: the DeepSpeed releases its tests ran on (CI's version matrix, .ci/run);
- ``targets``: every DeepSpeed function it replaces, calls or whose behaviour it relies on, each with the
  source fingerprints (dsclip/engine/fingerprint.py) of the verified releases (a function DeepSpeed defines
  inside another, such as each parameter's ``partition`` and ``all_gather_coalesced`` made in
  ``Init._convert_to_deepspeed_param``, is covered by the fingerprint of the function that defines it). A
  missing attribute or an unknown fingerprint means no patch: DeepSpeed's own path runs, and one line in
  the log names the patch, the installed version and the method that differs;
- ``requires``: the patches it builds on (``REQUIRES`` in its module; they come earlier in :data:`PATCHES`).
  Where one of them is off because its check failed or the selection leaves it out, this one is off too,
  with one line; where one does not apply to the engine, neither does this one (no line);
- ``stages``: the ZeRO stages it is for; on other stages it is not considered at all (no line: the normal
  case, e.g. ZeRO-1/2 patches under ZeRO-3). The fingerprint check comes next, then
- ``applies(engine)``: whether this engine is the plain case the patch handles (world, offload, layout ...);
  where it is not, DeepSpeed's path runs without a line (nothing is wrong with the installed DeepSpeed).

``build_engine`` calls :func:`install_patches` right after ``deepspeed.initialize``; every patch is scoped to
that engine (instance attributes of the engine, its optimizer, its modules and their parameters). One
function DeepSpeed looks up as a module global, ZeRO-3's ``iter_params``, gets a dispatcher instead
(``zero3_params``): it answers for the modules an engine with that patch marked and hands every other module
to DeepSpeed's own function.
``--engine-patches`` (run config ``engine_patches``) selects them: ``all`` (default: every patch but the
opt-in ones), ``none``, a comma list of names, ``all,-NAME`` to leave some out, ``all,+NAME`` to add an
opt-in one. A patch is in the default set only where it measured a gain of at least 3 % of a world-8 step
(bench/patches_world8.py); the rest are :data:`OPT_IN`. The rank line and run_config.yaml list what is
active. Outside this package and the guard (dsclip/engine/fingerprint.py) nothing touches a private
DeepSpeed name, except the engine's own probes beside it (accumulation.py, shm_op.py, shm_workspace.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsclip.engine.fingerprint import mismatched_target
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
    zero3_norm,
    zero3_params,
    zero3_release,
    zero3_step_views,
    zero3_traces,
)
from dsclip.engine.versions import deepspeed_version

# What the training step may ask of the seam (dsclip/train/ imports nothing below this package): one step
# without the global norm where grad_norm is active on the engine, a no-op elsewhere
norm_skipped = grad_norm.norm_skipped

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
    requires: tuple[str, ...] = ()  # patches this one builds on, installed before it


PATCHES: tuple[Patch, ...] = tuple(
    Patch(m.NAME, m.SUMMARY, m.VERIFIED, m.TARGETS, m.STAGES, m.applies, m.install, getattr(m, "REQUIRES", ()))
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
        zero3_forward_flags,  # requires zero3_blocks
    )
)
# Patches that act later than build_engine, where the engine does what they repair (a universal load):
# selected and checked the same way, applied by the code that calls them.
LOAD_TIME = (universal_zero3,)
NAMES = tuple(p.name for p in PATCHES) + tuple(m.NAME for m in LOAD_TIME)
# Available by name (``all,+NAME``) but not in ``all``: a gain under 3 % of the world-8 step, rank 0 of a
# world-8 job on the CPU rehearsal (bench/patches_world8.py, bench/results/patches-world8_cpu2_2026-12-06.md;
# a GPU run of that bench, at the next lease, replaces these figures). universal_zero3 repairs a load, not a
# speed: it is not measured and stays in.
OPT_IN: frozenset[str] = frozenset({"zero3_step_views", "zero3_hook_fns", "overflow_check", "grad_norm"})
DEFAULT = tuple(n for n in NAMES if n not in OPT_IN)
# Names that once were patches: a selection naming one gets told why it is gone
REMOVED = {
    "zero3_local_flush": "ZeRO-3 at one rank, which the planner never picks (ZeRO-2 holds the same memory there)",
    "zero3_local_persist": "ZeRO-3 at one rank, which the planner never picks (ZeRO-2 holds the same memory there)",
}


class PatchSelectionError(ValueError):
    pass


def known_patches() -> str:
    """The known names for an error line: the default set, then the opt-in ones."""
    opt_in = [n for n in NAMES if n in OPT_IN]
    return ", ".join(DEFAULT) + (f"; opt-in (all,+NAME): {', '.join(opt_in)}" if opt_in else "")


def parse_selection(spec: str) -> frozenset[str]:
    """``all`` | ``none`` | ``a,b`` | ``all,-a`` | ``all,+a`` -> the set of patch names to try."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    chosen: set[str] = set()
    for item in items or [ALL]:
        name = item.lstrip("-+")
        if item == ALL:
            chosen |= set(DEFAULT)
        elif item == NONE:
            chosen.clear()
        elif name in REMOVED:
            raise PatchSelectionError(
                f"--engine-patches: patch {name!r} was removed: {REMOVED[name]}; known: {known_patches()}"
            )
        elif name not in NAMES:
            raise PatchSelectionError(
                f"--engine-patches: unknown patch {name!r}; known: {known_patches()}; or 'all' / 'none'"
            )
        elif item.startswith("-"):
            chosen.discard(name)
        else:  # NAME or +NAME
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
        reason = check_patch(patch) or missing_prerequisite(patch, report)
        if reason is not None:
            report.refused[patch.name] = reason
            log(f"[dsclip] {reason}")
            continue
        if not all(r in report.active for r in patch.requires) or not patch.applies(engine):
            continue  # a prerequisite that does not apply to this engine: nor does this patch (no line)
        patch.install(engine)
        report.active.append(patch.name)
    for module in LOAD_TIME:  # listed as active where they would act (they check again when they do)
        if module.NAME in chosen and stage in module.STAGES and mismatched_target(module.TARGETS) is None:
            report.active.append(module.NAME)
    engine.dsclip_patches = report  # what tests, bench/ and the run config read
    return report


def missing_prerequisite(patch: Patch, report: PatchReport) -> str | None:
    """Why ``patch`` is off when a patch it requires is off (its check failed, or the selection leaves it out)."""
    for needed in patch.requires:
        if needed in report.refused:
            why = "which is off (its check failed, above)"
        elif needed not in report.selected:
            why = "which --engine-patches leaves out"
        else:
            continue
        return f"patch {patch.name} off: it requires {needed}, {why}; DeepSpeed's own path runs"
    return None


def active_patches(engine) -> list[str]:
    report = getattr(engine, "dsclip_patches", None)
    return list(report.active) if report is not None else []
