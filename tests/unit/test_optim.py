"""Weight-decay groups and learning-rate schedules (OpenCLIP's shapes)."""

import math

import pytest

from dsclip.config import make_run_config
from dsclip.engine.optim import lr_multiplier, param_groups
from dsclip.model import create_model


def test_no_decay_on_bias_norm_embeddings_and_scale():
    model = create_model("tiny")
    groups = param_groups(model, 0.2)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups[0]["params"]}
    decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["weight_decay"] == 0.2
    assert not (no_decay & decay) and len(no_decay) + len(decay) == len(names)
    assert "logit_scale" in no_decay
    assert all(
        (
            "bias" in n
            or "norm" in n
            or "ln" in n
            or "embed" in n
            or "token" in n
            or "scale" in n
            or "pos" in n
            or "cls" in n
            or "class" in n
        )
        for n in no_decay
    ), no_decay
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in decay)
    assert any("embed" in n or "pos" in n for n in no_decay)  # embeddings do not decay
    assert not any(n.endswith("bias") for n in decay)


def sched(**kw):
    kw.setdefault("name", "t")
    return make_run_config(kw).optim


def test_cosine_with_warmup():
    f = lr_multiplier(sched(warmup=10, lr_scheduler="cosine"), total_steps=110, steps_per_epoch=11)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.0, abs=1e-12)


def test_const_and_const_cooldown():
    f = lr_multiplier(sched(warmup=2, lr_scheduler="const"), total_steps=100, steps_per_epoch=10)
    assert [f(0), f(1), f(50), f(99)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    o = sched(
        warmup=0, lr=1.0, lr_scheduler="const-cooldown", epochs_cooldown=2, lr_cooldown_end=0.1, lr_cooldown_power=1.0
    )
    f = lr_multiplier(o, total_steps=100, steps_per_epoch=10)
    assert f(79) == pytest.approx(1.0)
    assert f(80) == pytest.approx(1.0)
    assert f(90) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
