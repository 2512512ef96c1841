"""Gradient-cache logic that fp16 relies on, against a scripted engine (fp16 does not run on this CPU).

The fake engine mimics what DeepSpeed's fp16 path does to us: ``backward`` multiplies the scalar it
is given by the loss scale, and ``step`` skips the update on overflow. The tests check that the
cached gradients come from the unscaled loss (scale applied exactly once), that the temperature
gradient enters once per step, that non-finite embeddings skip the step, and the boundary protocol.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsclip.train.gradcache import GradCacheStep


class TinyTowers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.img = nn.Linear(6, 4)
        self.txt = nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor([2.0]))
        self.drop = nn.Dropout(0.5)

    def forward(self, image, text):
        i = F.normalize(self.drop(self.img(image)), dim=-1)
        t = F.normalize(self.txt(text.float()), dim=-1)
        return {
            "image_features": i,
            "text_features": t,
            "logit_scale": self.logit_scale.exp().squeeze(0),
            "logit_bias": None,
        }


class FakeFp16Engine:
    """The parts of DeepSpeedEngine the gradient cache uses, with a loss scale and overflow."""

    def __init__(self, module, loss_scale=1024.0, overflow=False):
        self.module = module
        self.device = torch.device("cpu")
        self.loss_scale = loss_scale
        self.overflow = overflow
        self.optimizer = object()  # no _coalesce_grad_reduction: "boundary" reduction is chosen
        self.boundaries: list[bool] = []
        self.backward_calls = 0
        self.steps = 0
        self.applied = None

    def __call__(self, **kw):
        return self.module(**kw)

    def zero_optimization_stage(self):
        return 0

    def fp16_enabled(self):
        return True

    def bfloat16_enabled(self):
        return False

    def coalesce_grad_reduction(self):
        return contextlib.nullcontext()

    def set_gradient_accumulation_boundary(self, b):
        self.boundaries.append(b)

    def backward(self, loss):
        assert loss.dim() == 0, "DeepSpeed's engine.scale/backward only take scalars"
        self.backward_calls += 1
        (loss * self.loss_scale).backward()

    def step(self):
        self.steps += 1
        self.applied = not self.overflow

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return None


def reference_loss(img, txt, scale):
    logits = scale * img @ txt.T
    y = torch.arange(len(img))
    return 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y))


def infonce(img, txt, scale, bias=None):
    return reference_loss(img, txt, scale)


def batches(k, b=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(b, 6, generator=g), torch.randn(b, 5, generator=g)) for _ in range(k)]


def test_loss_scale_applied_once_and_temperature_once():
    k, scale = 3, 1024.0
    model = TinyTowers()
    engine = FakeFp16Engine(model, loss_scale=scale)
    torch.manual_seed(11)
    res = GradCacheStep(engine, infonce, keep_last_graph=False)(batches(k))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_model = TinyTowers()
    torch.manual_seed(11)  # the same dropout masks: chunks drawn in order
    outs = [ref_model(image=i, text=t) for i, t in batches(k)]
    loss = reference_loss(
        torch.cat([o["image_features"] for o in outs]),
        torch.cat([o["text_features"] for o in outs]),
        outs[-1]["logit_scale"],
    )
    loss.backward()
    for n, p in ref_model.named_parameters():
        # the engine scaled the surrogate once: grads are exactly loss_scale x the big-batch gradient
        torch.testing.assert_close(got[n], scale * p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert abs(res.loss - loss.item()) < 1e-6  # the reported loss is the big-batch loss
    assert engine.backward_calls == k and engine.steps == 1
    assert engine.boundaries[:k] == [False] * (k - 1) + [True]


def test_overflow_skips_the_step_and_reports_it():
    engine = FakeFp16Engine(TinyTowers(), overflow=True)
    res = GradCacheStep(engine, infonce)(batches(2))
    assert not res.applied and "overflow" in res.skip_reason
    assert engine.steps == 1  # DeepSpeed itself skips the update and keeps its counters


def test_non_finite_embeddings_skip_without_backward():
    model = TinyTowers()
    engine = FakeFp16Engine(model)
    bad = batches(2)
    bad[1] = (torch.full_like(bad[1][0], float("inf")), bad[1][1])
    res = GradCacheStep(engine, infonce)(bad)
    assert not res.applied and res.skip_reason == "non-finite embeddings"
    assert engine.backward_calls == 0 and engine.steps == 0
    assert all(p.grad is None for p in model.parameters())


def test_kept_graph_saves_one_forward():
    calls = {"n": 0}
    model = TinyTowers()
    model.img.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    GradCacheStep(FakeFp16Engine(model), infonce, keep_last_graph=True)(batches(4))
    assert calls["n"] == 4 + 3  # pass 1: 4 chunks; pass 2 re-forwards only the 3 not kept
    calls["n"] = 0
    GradCacheStep(FakeFp16Engine(model), infonce, keep_last_graph=False)(batches(4))
    assert calls["n"] == 8


class FakeBf16ZeroEngine(FakeFp16Engine):
    """A bf16 ZeRO-2/3 engine as the gradient cache sees it: a coalescing optimizer, fp32 accumulation."""

    def __init__(self, module, stage):
        super().__init__(module)
        self.stage = stage
        self.optimizer = type("Opt", (), {"_coalesce_grad_reduction": False})()

    def zero_optimization_stage(self):
        return self.stage

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return True

    def get_data_types(self):
        return torch.bfloat16, torch.float32


@pytest.mark.parametrize("stage", [2, 3])
def test_library_callers_get_the_clis_reduction_and_refusals(stage):
    """GradCacheStep defaults to --grad-reduction auto as `dsclip train` resolves it (a bf16 ZeRO-2/3 engine at
    K = 256 sums in fp32: sharded), and refuses the 16-bit coalesced sum the CLI refuses, with its message."""
    from dsclip.config_base import ConfigError
    from dsclip.engine.ds_config import TrainArgs, grad_reduction_of

    engine = FakeBf16ZeroEngine(TinyTowers(), stage)
    step = GradCacheStep(engine, infonce, accum_freq=256, compute_dtype=torch.bfloat16)
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    cli = grad_reduction_of(ds, TrainArgs(accum_freq=256, grad_reduction="auto"), 1)
    assert step.grad_reduction == step.reduction == cli == "sharded"
    with pytest.raises(ConfigError) as refused:
        GradCacheStep(engine, infonce, accum_freq=256, grad_reduction="coalesced", compute_dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as cli_refused:
        grad_reduction_of(ds, TrainArgs(accum_freq=256, grad_reduction="coalesced"), 1)
    assert str(refused.value) == str(cli_refused.value) and "sum 256 chunk gradients in bf16" in str(refused.value)
