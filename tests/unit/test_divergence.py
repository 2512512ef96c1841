"""The divergence guard's streak rule (dsclip.train.divergence) and the resume's optimizer-setting diff
(dsclip.checkpoint.resume_optim), without an engine."""

from __future__ import annotations

from types import SimpleNamespace

from dsclip.checkpoint import resume_optim
from dsclip.config import make_run_config
from dsclip.train.divergence import DivergenceGuard


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
