"""The seam's mechanics (dsclip/engine/patches/): selection, the capability check and its one-line fallback.

The patches' numbers are tested where they act (tests/dist/test_local_flush.py bit for bit against
DeepSpeed's path, tests/dist/test_gradcache.py against a big-batch reference with patches on and off)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsclip.engine import patches as P
from dsclip.engine.fingerprint import fingerprint, mismatched_target, resolve
from dsclip.engine.versions import deepspeed_version


def test_selection_all_none_names_and_exclusions():
    assert P.parse_selection("all") == set(P.DEFAULT) == set(P.NAMES) - P.OPT_IN
    assert P.parse_selection("none") == set()
    assert P.parse_selection("local_flush, grad_hooks") == {"local_flush", "grad_hooks"}
    assert P.parse_selection("all,-local_flush") == set(P.DEFAULT) - {"local_flush"}
    with pytest.raises(P.PatchSelectionError, match="unknown patch 'local_flsh'; known: local_flush"):
        P.parse_selection("all,-local_flsh")


def test_opt_in_patches_are_added_by_plus_name_and_only_then(monkeypatch):
    monkeypatch.setattr(P, "OPT_IN", frozenset({"grad_norm"}))
    monkeypatch.setattr(P, "DEFAULT", tuple(n for n in P.NAMES if n != "grad_norm"))
    assert "grad_norm" not in P.parse_selection("all")
    assert P.parse_selection("all,+grad_norm") == set(P.NAMES)
    assert P.parse_selection("grad_norm") == {"grad_norm"}  # named alone: selected
    assert P.parse_selection("all,+grad_norm,-grad_norm") == set(P.NAMES) - {"grad_norm"}
    with pytest.raises(P.PatchSelectionError, match=r"known: .*; opt-in \(all,\+NAME\): grad_norm;"):
        P.parse_selection("all,+nope")


@pytest.mark.parametrize("spec", ["all,-zero3_local_flush", "zero3_local_persist", "all,+zero3_local_flush"])
def test_a_removed_patch_is_one_line_that_lists_the_known_ones(spec):
    with pytest.raises(P.PatchSelectionError) as e:
        P.parse_selection(spec)
    line = str(e.value)
    assert "\n" not in line and "was removed" in line and "ZeRO-3 at one rank" in line
    assert line.split("known: ")[1].split(", ")[0] == P.DEFAULT[0] and all(n in line for n in P.NAMES)


def test_the_one_rank_zero3_patches_are_gone():
    assert not {"zero3_local_flush", "zero3_local_persist"} & set(P.NAMES)
    import importlib.util

    assert importlib.util.find_spec("dsclip.engine.patches.zero3_local_flush") is None


def test_every_patch_declares_versions_targets_and_each_target_exists_here():
    """On a DeepSpeed a patch was verified on, every target resolves (a missing one would be a silent no-op);
    on another (CI's oldest, for the patches verified on the newest only) a missing target is that patch's
    one-line fallback."""
    assert len(set(P.NAMES)) == len(P.NAMES)
    for patch in P.PATCHES:
        assert patch.verified and patch.targets and patch.stages, patch.name
        for target in patch.targets if deepspeed_version() in patch.verified else ():
            assert resolve(target) is not None, target


def test_patches_holds_patches_only():
    """Every module in dsclip/engine/patches/ is a patch the registry knows (helpers live in dsclip/engine/)."""
    from pathlib import Path

    folder = Path(P.__file__).parent
    modules = {f.stem for f in folder.glob("*.py")} - {"__init__"}
    assert modules == set(P.NAMES)


# What a patch's source uses -> the DeepSpeed function whose fingerprint must guard it. Functions DeepSpeed
# defines per parameter (``partition``, ``all_gather_coalesced``) are covered by the function defining them.
_I = "deepspeed.runtime.zero.partition_parameters:"
USES = {
    ".all_gather_coalesced(": _I + "Init._convert_to_deepspeed_param",
    ".partition(": _I + "Init._convert_to_deepspeed_param",
    "_PartitionedParameterCoordinator__": (
        "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.__init__"
    ),
    "._get_param_partition_group(": (
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._get_param_partition_group"
    ),
    "z3_leaf_module": "deepspeed.utils:z3_leaf_module",
}


@pytest.mark.parametrize("name", [p.name for p in P.PATCHES])
def test_what_a_patch_calls_or_reads_is_in_its_fingerprinted_targets(name):
    import importlib
    import inspect

    module = importlib.import_module(f"dsclip.engine.patches.{name}")
    source = inspect.getsource(module)
    patch = next(p for p in P.PATCHES if p.name == name)
    missing = [target for use, target in USES.items() if use in source and target not in patch.targets]
    assert not missing, f"{name} uses {missing} without fingerprinting them"
    if ".wait()" in source and "all_gather_coalesced" in source:  # the gather's handle, waited on
        assert _I + "AllGatherCoalescedHandle.wait" in patch.targets, name


def test_zero3_blocks_guards_the_gather_and_release_it_calls(monkeypatch):
    """A DeepSpeed whose per-parameter partition()/all_gather_coalesced (defined in
    Init._convert_to_deepspeed_param) differ turns zero3_blocks off, not only zero3_release."""
    from deepspeed.runtime.zero.partition_parameters import Init

    blocks = next(p for p in P.PATCHES if p.name == "zero3_blocks")
    assert "deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param" in blocks.targets
    if deepspeed_version() not in blocks.verified:
        pytest.skip(f"zero3_blocks is off on DeepSpeed {deepspeed_version()} already")
    assert P.check_patch(blocks) is None

    def _convert_to_deepspeed_param(self, param):  # a changed release
        return None

    monkeypatch.setattr(Init, "_convert_to_deepspeed_param", _convert_to_deepspeed_param)
    line = P.check_patch(blocks)
    assert line is not None and "Init._convert_to_deepspeed_param (source changed" in line


def test_declared_prerequisites_come_first_and_exist():
    order = [p.name for p in P.PATCHES]
    pairs = [(p.name, r) for p in P.PATCHES for r in p.requires]
    assert ("zero3_forward_flags", "zero3_blocks") in pairs
    for name, needed in pairs:
        assert needed in order and order.index(needed) < order.index(name), (name, needed)


def test_fingerprint_changes_with_the_source():
    def a(x):
        return x + 1

    def b(x):
        return x + 2

    assert fingerprint(a) != fingerprint(b) and len(fingerprint(a)) == 12
    target = "deepspeed.runtime.engine:DeepSpeedEngine.step"
    known = fingerprint(resolve(target))
    assert mismatched_target({target: frozenset({known})}) is None
    assert "source changed" in mismatched_target({target: frozenset({"000000000000"})})
    assert "missing" in mismatched_target({"deepspeed.runtime.engine:DeepSpeedEngine.no_such": frozenset()})


def _fake_engine(stage=2):
    return SimpleNamespace(zero_optimization_stage=lambda: stage)


def _fake_patch(name, fingerprint_ok, installed, stages=(1, 2), applies=True, requires=()):
    target = "deepspeed.runtime.engine:DeepSpeedEngine.step"
    known = fingerprint(resolve(target)) if fingerprint_ok else "000000000000"
    return P.Patch(
        name,
        "",
        ("0.19.8",),
        {target: frozenset({known})},
        stages,
        lambda e: applies,
        lambda e: installed.append(name),
        requires,
    )


def _with_fakes(monkeypatch, fakes):
    monkeypatch.setattr(P, "PATCHES", fakes)
    monkeypatch.setattr(P, "NAMES", tuple(p.name for p in fakes))
    monkeypatch.setattr(P, "DEFAULT", P.NAMES)


def test_a_patch_whose_prerequisite_is_off_is_off_too_with_one_line(monkeypatch):
    installed = []
    base_ok, base_stale = _fake_patch("base", True, installed), _fake_patch("base", False, installed)
    dependent = _fake_patch("dependent", True, installed, requires=("base",))
    # the prerequisite's check failed: its line, then the dependent's
    _with_fakes(monkeypatch, (base_stale, dependent))
    lines = []
    report = P.install_patches(_fake_engine(), "all", log=lines.append)
    assert installed == [] and report.active == [] and list(report.refused) == ["base", "dependent"]
    assert len(lines) == 2 and lines[1] == (
        "[dsclip] patch dependent off: it requires base, which is off (its check failed, above); "
        "DeepSpeed's own path runs"
    )
    # the selection leaves the prerequisite out: one line for the dependent
    _with_fakes(monkeypatch, (base_ok, dependent))
    lines.clear()
    report = P.install_patches(_fake_engine(), "all,-base", log=lines.append)
    assert installed == [] and lines == [
        "[dsclip] patch dependent off: it requires base, which --engine-patches leaves out; DeepSpeed's own path runs"
    ]
    # the prerequisite does not apply to this engine (e.g. offload): neither does the dependent, no line
    _with_fakes(monkeypatch, (_fake_patch("base", True, installed, applies=False), dependent))
    lines.clear()
    assert P.install_patches(_fake_engine(), "all", log=lines.append).active == [] and lines == [] == installed
    # both on: both installed, prerequisite first
    _with_fakes(monkeypatch, (base_ok, dependent))
    assert P.install_patches(_fake_engine(), "all", log=lines.append).active == ["base", "dependent"]
    assert installed == ["base", "dependent"] and lines == []


def test_a_changed_deepspeed_gets_its_own_path_and_one_line(monkeypatch):
    installed, lines = [], []
    fakes = (
        _fake_patch("good", True, installed),
        _fake_patch("stale", False, installed),
        _fake_patch("zero3_only", False, installed, stages=(3,)),  # other stage: not even checked, no line
        _fake_patch("not_plain", True, installed, applies=False),  # e.g. offload: DeepSpeed's path, no line
    )
    _with_fakes(monkeypatch, fakes)
    engine = _fake_engine()
    report = P.install_patches(engine, "all", log=lines.append)
    assert installed == ["good"] and report.active == ["good"] and engine.dsclip_patches is report
    assert list(report.refused) == ["stale"] and len(lines) == 1
    line = lines[0]
    assert line.startswith("[dsclip] patch stale off: DeepSpeed ") and deepspeed_version() in line
    assert "DeepSpeedEngine.step (source changed" in line and "verified: DeepSpeed 0.19.8" in line
    assert line.endswith("DeepSpeed's own path runs")
    assert report.describe() == "patches good"
    installed.clear()
    assert P.install_patches(_fake_engine(), "none", log=lines.append).describe() == "patches none"
    assert installed == []


def test_setup_py_declares_the_tested_range_up_to_the_next_minor():
    import re
    from pathlib import Path

    from dsclip.engine.versions import NEXT_MINOR, TESTED_MAX, TESTED_MIN, _key

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert re.search(rf'"deepspeed>={re.escape(TESTED_MIN)},<{re.escape(NEXT_MINOR)}"', setup)
    assert _key(TESTED_MAX) < _key(NEXT_MINOR)


def test_outside_the_tested_range_is_one_line_and_not_an_error():
    from dsclip.engine.versions import has_coalesced_reduction, outside_tested_range

    assert outside_tested_range("0.19.2") is None and outside_tested_range("0.19.8") is None
    assert outside_tested_range("0.19.5+cu130") is None
    line = outside_tested_range("0.20.1")
    assert line.startswith("dsclip: DeepSpeed 0.20.1 is outside the range") and "0.19.2 to 0.19.8" in line
    assert outside_tested_range("0.18.9") is not None
    assert has_coalesced_reduction("0.19.2") and not has_coalesced_reduction("0.18.9")


def test_an_untested_patch_release_gets_the_line_and_the_patches_whose_fingerprints_match(monkeypatch, capsys):
    """DeepSpeed 0.19.9 (pip allows it, CI has not run it): start-up says so in one line and goes on; at
    install each patch is judged by its own sources alone (here one target changed, the other not)."""
    from dsclip.config import make_run_config
    from dsclip.engine import versions
    from dsclip.train import preflight

    monkeypatch.setattr(versions, "deepspeed_version", lambda: "0.19.9")
    monkeypatch.setattr(P, "deepspeed_version", lambda: "0.19.9")
    preflight._check_deepspeed(make_run_config({"name": "t", "accum_freq": 2}), rank=0)  # no refusal
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "DeepSpeed 0.19.9 is outside the range dsclip is tested on" in out
    assert "going on with the engine patches whose checks pass" in out
    installed, lines = [], []
    fakes = (_fake_patch("matches", True, installed), _fake_patch("changed", False, installed))
    monkeypatch.setattr(P, "PATCHES", fakes)
    monkeypatch.setattr(P, "NAMES", tuple(p.name for p in fakes))
    monkeypatch.setattr(P, "DEFAULT", P.NAMES)
    report = P.install_patches(_fake_engine(), "all", log=lines.append)
    assert installed == ["matches"] and report.active == ["matches"]
    assert lines == [f"[dsclip] {report.refused['changed']}"] and "DeepSpeed 0.19.9's" in lines[0]


def test_preflight_refuses_accum_freq_on_a_deepspeed_without_coalesced_reduction(monkeypatch, capsys):
    """Issue #34 at start-up: from the version alone, before the process group or a DeepSpeed import."""
    from dsclip.config import make_run_config
    from dsclip.config_base import ConfigError
    from dsclip.train import preflight

    for module in ("dsclip.engine.versions", "dsclip.engine.accumulation"):
        monkeypatch.setattr(f"{module}.deepspeed_version", lambda: "0.18.9")
    cfg = make_run_config({"name": "t", "accum_freq": 4})
    with pytest.raises(
        ConfigError, match=r"--accum-freq 4 needs DeepSpeed >= 0.19.2 .* DeepSpeed 0.18.9 .*--accum-freq 1"
    ):
        preflight._check_deepspeed(cfg, rank=0)
    preflight._check_deepspeed(make_run_config({"name": "t", "accum_freq": 1}), rank=0)  # goes on, one line
    assert capsys.readouterr().out.count("outside the range") == 1
    with pytest.raises(ConfigError, match="unknown patch 'flush'"):
        preflight._check_deepspeed(make_run_config({"name": "t", "engine_patches": "all,-flush"}), rank=0)


def test_zero3_params_dispatcher_keeps_the_version_guard_true_for_the_next_engine(monkeypatch):
    # a second ZeRO-3 engine in one process (bench/gpu_bench.py builds several) fingerprints iter_params after
    # the first engine put its dispatcher there: the guard must still see DeepSpeed's function
    import deepspeed.runtime.zero.parameter_offload as offload
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    from dsclip.engine.patches import zero3_params

    monkeypatch.setattr(coordinator, "iter_params", coordinator.iter_params)
    monkeypatch.setattr(offload, "iter_params", offload.iter_params)
    assert mismatched_target(zero3_params.TARGETS) is None
    zero3_params._install_dispatcher()
    assert getattr(coordinator.iter_params, "dsclip_dispatcher", False)
    assert mismatched_target(zero3_params.TARGETS) is None


def test_the_training_step_asks_the_engine_not_a_patch_module():
    """dsclip/train/ reaches the seam through its registry only (dsclip.engine.patches), never a patch module."""
    import ast
    from pathlib import Path

    train = Path(P.__file__).resolve().parents[2] / "train"
    offenders = [
        f"{path.name}: {node.module}"
        for path in sorted(train.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsclip.engine.patches.")
    ]
    assert not offenders, offenders


def test_help_names_the_opt_in_patches_and_plus_name():
    from dataclasses import fields

    from dsclip.engine.ds_config import TrainArgs

    text = next(f.metadata["help"] for f in fields(TrainArgs) if f.name == "engine_patches")
    assert "all,+NAME" in text and all(n in text for n in P.OPT_IN)
    assert not any(n in text for n in P.DEFAULT if n not in P.OPT_IN)


def test_train_preflight_refuses_a_removed_patch_in_one_line():
    """What `dsclip train --engine-patches all,-zero3_local_persist` prints before any work."""
    from dsclip.config import make_run_config
    from dsclip.config_base import ConfigError
    from dsclip.train import preflight

    cfg = make_run_config({"name": "t", "engine_patches": "all,-zero3_local_persist"})
    with pytest.raises(ConfigError) as e:
        preflight._check_deepspeed(cfg, rank=0)
    assert "\n" not in str(e.value) and "'zero3_local_persist' was removed" in str(e.value)
    assert "known: local_flush" in str(e.value)
