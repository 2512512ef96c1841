"""The seam's mechanics (dsclip/engine/patches/): selection, the capability check and its one-line fallback.

The patches' numbers are tested where they act (tests/dist/test_local_flush.py bit for bit against
DeepSpeed's path, tests/dist/test_gradcache.py against a big-batch reference with patches on and off)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsclip.engine import patches as P
from dsclip.engine.patches.fingerprint import deepspeed_version, fingerprint, mismatched_target, resolve


def test_selection_all_none_names_and_exclusions():
    assert P.parse_selection("all") == set(P.NAMES)
    assert P.parse_selection("none") == set()
    assert P.parse_selection("local_flush, grad_hooks") == {"local_flush", "grad_hooks"}
    assert P.parse_selection("all,-local_flush") == set(P.NAMES) - {"local_flush"}
    with pytest.raises(P.PatchSelectionError, match="unknown patch 'local_flsh'; known: local_flush"):
        P.parse_selection("all,-local_flsh")


def test_every_patch_declares_versions_targets_and_each_target_exists_here():
    """On the DeepSpeed this suite runs on every target resolves (a missing one would be a silent no-op)."""
    assert len(set(P.NAMES)) == len(P.NAMES)
    for patch in P.PATCHES:
        assert patch.verified and patch.targets and patch.stages, patch.name
        for target in patch.targets:
            assert resolve(target) is not None, target


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


def _fake_patch(name, fingerprint_ok, installed, stages=(1, 2), applies=True):
    target = "deepspeed.runtime.engine:DeepSpeedEngine.step"
    known = fingerprint(resolve(target)) if fingerprint_ok else "000000000000"
    return P.Patch(
        name, "", ("0.19.8",), {target: frozenset({known})}, stages, lambda e: applies, lambda e: installed.append(name)
    )


def test_a_changed_deepspeed_gets_its_own_path_and_one_line(monkeypatch):
    installed, lines = [], []
    fakes = (
        _fake_patch("good", True, installed),
        _fake_patch("stale", False, installed),
        _fake_patch("zero3_only", False, installed, stages=(3,)),  # other stage: not even checked, no line
        _fake_patch("not_plain", True, installed, applies=False),  # e.g. offload: DeepSpeed's path, no line
    )
    monkeypatch.setattr(P, "PATCHES", fakes)
    monkeypatch.setattr(P, "NAMES", tuple(p.name for p in fakes) + ("universal_zero3",))
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


def test_setup_py_declares_the_tested_range():
    import re
    from pathlib import Path

    from dsclip.engine.patches.versions import TESTED_MAX, TESTED_MIN

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert re.search(rf'"deepspeed>={re.escape(TESTED_MIN)},<={re.escape(TESTED_MAX)}"', setup)


def test_outside_the_tested_range_is_one_line_and_not_an_error():
    from dsclip.engine.patches.versions import has_coalesced_reduction, outside_tested_range

    assert outside_tested_range("0.19.2") is None and outside_tested_range("0.19.8") is None
    assert outside_tested_range("0.19.5+cu130") is None
    line = outside_tested_range("0.20.1")
    assert line.startswith("dsclip: DeepSpeed 0.20.1 is outside the range") and "0.19.2 to 0.19.8" in line
    assert outside_tested_range("0.18.9") is not None
    assert has_coalesced_reduction("0.19.2") and not has_coalesced_reduction("0.18.9")


def test_preflight_refuses_accum_freq_on_a_deepspeed_without_coalesced_reduction(monkeypatch, capsys):
    """Issue #34 at start-up: from the version alone, before the process group or a DeepSpeed import."""
    from dsclip.config import make_run_config
    from dsclip.config_base import ConfigError
    from dsclip.engine.patches import fingerprint
    from dsclip.train import preflight

    monkeypatch.setattr(fingerprint, "deepspeed_version", lambda: "0.18.9")
    for module in ("dsclip.engine.patches.versions", "dsclip.engine.patches.accumulation"):
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
