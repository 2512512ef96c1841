"""--ema-decay's settings, its memory in `dsclip plan`, and its refusals (one line, before anything is built)."""

import pytest

from dsclip.config import ConfigError, make_run_config
from dsclip.model.lock import LockConfig
from dsclip.plan.memory import model_state_bytes
from dsclip.plan.planner import make_plan

GiB = 2**30


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_plan_counts_one_fp32_copy_of_the_trainable_params_over_the_world(zero):
    base = model_state_bytes(10_000_000, 8, zero, "bf16", trainable_params=6_000_000)
    with_ema = model_state_bytes(10_000_000, 8, zero, "bf16", trainable_params=6_000_000, ema=True)
    assert {k: v for k, v in with_ema.items() if k != "ema"} == base
    assert with_ema["ema"] == 4 * 6_000_000 / 8  # sharded like the master partition; locked params not averaged


def test_plan_total_grows_by_the_ema():
    kw = dict(gpus=8, gpu_memory_gb=80, batch_size=256, zero=2, lock=LockConfig(lock_image=True))
    a, b = make_plan("ViT-B-32", **kw), make_plan("ViT-B-32", **kw, ema=True)
    assert b.memory_gb["ema"] == pytest.approx(4 * a.trainable_params / 8 / GiB, abs=1e-3)
    assert b.memory_gb["total"] == pytest.approx(a.memory_gb["total"] + b.memory_gb["ema"], abs=2e-3)


@pytest.mark.parametrize(
    "values,fragment",
    [
        ({"ema_decay": 1.0}, r"--ema-decay 1 is outside \(0, 1\)"),
        ({"ema_decay": 0.0}, r"--ema-decay 0 is outside \(0, 1\)"),
        ({"ema_decay": -0.5}, r"outside \(0, 1\)"),
        ({"eval_ema": True}, "--eval-ema needs --ema-decay"),
        ({"ema_decay": 0.99, "ema_start_step": -1}, "--ema-start-step must be >= 0"),
    ],
)
def test_bad_ema_settings_are_one_line(values, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        make_run_config(values)
    assert "\n" not in str(e.value)


def test_ema_with_every_parameter_frozen_is_refused_before_the_model():
    # the lock check (train/finetune.prepare, before any construction) refuses a run with nothing to train,
    # so nothing to average; dsclip.train.ema_step refuses it again on the built model
    from dsclip.model import get_model_config, resolve_model_config
    from dsclip.model.lock import LockError, check_lock_config

    cfg = make_run_config(
        {"ema_decay": 0.999, "lock_image": True, "lock_text": True, "lock_text_freeze_layer_norm": True}
    )
    with pytest.raises(LockError, match="nothing is left to train"):
        check_lock_config(cfg.lock, resolve_model_config(get_model_config("tiny")))


def test_ema_on_a_built_model_with_nothing_trainable_is_refused():
    from types import SimpleNamespace

    from dsclip.model import create_model
    from dsclip.train import ema_step

    model = create_model("tiny", device="meta")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="every parameter frozen: nothing to average"):
        ema_step.attach(make_run_config({"ema_decay": 0.9}).ema, SimpleNamespace(module=model), None, None)
