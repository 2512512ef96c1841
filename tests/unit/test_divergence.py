"""The divergence guard's streak rule (dsclip.train.divergence) and the resume's optimizer-setting diff
(dsclip.checkpoint.resume_optim), without an engine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsclip.checkpoint import resume_optim
from dsclip.checkpoint.ds_checkpoint import CheckpointArgs
from dsclip.config import make_run_config
from dsclip.config_base import ConfigError
from dsclip.train.divergence import DivergenceGuard, HealthRule, resumed_problem


def _step(loss, applied=True, reason=None):
    return SimpleNamespace(loss=loss, applied=applied, skip_reason=reason)


def test_streak_of_skipped_or_nonfinite_steps_stops_and_a_good_step_resets_it():
    g = DivergenceGuard(3)
    assert g.observe(1, _step(2.0)) and g.good_to_save
    assert not g.observe(2, _step(float("nan"), applied=False))  # NaN, skipped
    assert not g.observe(3, _step(2.0, applied=False, reason="fp16 overflow (loss scale reduced)"))
    assert not g.good_to_save and not g.diverged
    assert g.observe(4, _step(1.9)) and g.streak == 0  # recovered: fp16's occasional overflow is no divergence
    for step in (5, 6, 7):
        g.observe(step, _step(float("inf")))  # applied but infinite: not good either
    assert g.diverged and "3 consecutive steps" in g.describe(7) and "steps 5-7" in g.describe(7)
    msg = str(g.error(7, None))
    assert "no checkpoint from before the divergence" in msg and "--max-skipped-steps (now 3" in msg


def test_zero_never_stops():
    g = DivergenceGuard(0)
    for step in range(1, 100):
        g.observe(step, _step(float("nan"), applied=False))
    assert not g.diverged and not g.good_to_save


def test_optimizer_changes_name_old_and_new_values():
    old = resume_optim.recorded(make_run_config({"name": "x", "lr": 5e-4}).optim, 100)
    new = resume_optim.recorded(make_run_config({"name": "x", "lr": 1e-4, "warmup": 5}).optim, 200)
    assert resume_optim.changes(old, new, None, None) == [
        "--lr 0.0001 (checkpoint had 0.0005)",
        "--warmup 5 (checkpoint had 10000)",
        "schedule length 200 steps (--epochs/--max-steps; checkpoint had 100)",
    ]
    assert resume_optim.changes(old, dict(old), None, None) == []


def test_checkpoint_without_a_record_is_compared_on_the_loaded_lr_and_wd_and_this_runs_are_applied():
    """An older dsclip's checkpoint has no "optim" record: the load put its lr/wd into the engine, which is
    what is compared; applying puts this run's back and re-positions the schedule at the resume step."""
    import torch

    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [b], "weight_decay": 0.0}, {"params": [w], "weight_decay": 0.05}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 if s >= 3 else 1.0)
    engine = SimpleNamespace(lr_scheduler=sched, optimizer=opt)
    built = resume_optim.snapshot(engine)
    sched.base_lrs = [5e-4, 5e-4]  # what load_checkpoint restores: the checkpoint's run
    opt.param_groups[1]["weight_decay"] = 0.2
    said = []
    found = resume_optim.reconcile(engine, built, None, {}, 4, say=said.append)
    assert found == ["--lr 0.001 (checkpoint had 0.0005)", "--wd 0.05 (checkpoint had 0.2)"]
    assert said == ["resume: --lr 0.001 (checkpoint had 0.0005), --wd 0.05 (checkpoint had 0.2): applied from step 5"]
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]  # 1e-3 x the schedule's 0.5 at step 4
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.05]
    assert resume_optim.reconcile(engine, built, None, {}, 4, say=said.append) == [] and len(said) == 1


# --- the finite-divergence rule (issue 52) ---------------------------------------------------------------

CURVES = Path(__file__).parent / "data" / "healthy_curves.json"


def _healthy(loss, scale, applied=True):
    return SimpleNamespace(loss=loss, applied=applied, skip_reason=None, logit_scale=scale)


def test_rule_never_fires_on_the_recorded_healthy_curves():
    """The demo recipe's 384 steps (warm-up included), a resume at a 5x higher --lr and the tiny recipe, as
    recorded (the commands are in the file). A resumed start builds a new guard: its window starts empty."""
    curves = json.loads(CURVES.read_text())["curves"]
    assert len(curves["demo_384_steps"]["steps"]) == 384
    for name, curve in curves.items():
        guard = DivergenceGuard(20, HealthRule())
        for step, loss, scale, _lr in curve["steps"]:
            if step == curve.get("resumed_at", -1) + 1:
                guard = DivergenceGuard(20, HealthRule())
                assert resumed_problem(guard.rule, scale) is None  # the resumed weights pass too
            assert guard.observe(step, _healthy(loss, scale)), (name, step, guard.last_reason)


def test_rule_fires_at_once_on_a_finite_blow_up():
    # --config tiny --warmup 10000 --lr 1e3, as recorded: the loss stays near ln 16, the logit scale falls
    scales = [14.29, 12.93, 11.27, 9.15, 7.16, 5.30, 3.88, 2.81, 2.03, 1.46]
    losses = [3.0116, 2.7773, 5.9311, 2.9283, 3.1250, 2.7738, 2.7781, 2.7751, 2.7737, 2.7729]
    guard = DivergenceGuard(20, HealthRule())
    verdicts = [guard.observe(i + 1, _healthy(loss, s)) for i, (loss, s) in enumerate(zip(losses, scales))]
    assert verdicts[0] and not any(verdicts[1:]) and guard.unhealthy and guard.ended_unhealthy
    assert "--divergence-scale-step 0.05" in guard.describe(10)
    # --lr 1e6: step 2 is skipped (non-finite gradients) with a finite loss and a scale of 0
    guard = DivergenceGuard(20, HealthRule())
    assert guard.observe(1, _healthy(3.01, 14.29))
    assert not guard.observe(2, SimpleNamespace(loss=2.773, applied=False, skip_reason="x", logit_scale=5e-43))
    assert guard.ended_unhealthy and "below --divergence-min-scale 1" in guard.describe(2)
    # a loss far above its recent course, the scale steady
    guard = DivergenceGuard(20, HealthRule())
    for step in range(1, 31):
        assert guard.observe(step, _healthy(2.0 + 0.01 * (step % 3), 14.0))
    assert not guard.observe(31, _healthy(4.0, 14.0)) and "above" in guard.describe(31)
    # fp16 overflow skips alone (finite loss, sane scale) are no unhealthy end
    guard = DivergenceGuard(20, HealthRule())
    guard.observe(1, _healthy(2.0, 14.0))
    assert not guard.observe(2, SimpleNamespace(loss=2.0, applied=False, skip_reason="fp16", logit_scale=14.0))
    assert not guard.ended_unhealthy


@pytest.mark.parametrize(
    "field, value, expect",
    [
        ("divergence_window", -1, "--divergence-window must be >= 0"),
        ("divergence_k", 0.0, "--divergence-k must be > 0"),
        ("divergence_min_scale", float("nan"), "--divergence-min-scale must be >= 0"),
        ("divergence_scale_step", -0.1, "--divergence-scale-step must be > 0"),
    ],
)
def test_out_of_range_bounds_are_one_line(field, value, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        CheckpointArgs(**{field: value}).check()
    assert "\n" not in str(e.value)
