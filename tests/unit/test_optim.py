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


def test_offload_optimizer_is_deepspeed_cpu_adam_with_adamw_semantics():
    """Under offload_optimizer dsclip hands ZeRO DeepSpeedCPUAdam: same groups (decay only on matrices),
    same lr/betas/eps, decoupled decay. Three steps on the same gradients must give torch AdamW's weights;
    a wrong group, coupled (L2) decay or a dropped bias correction moves them by ~lr (1e-2 here)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from dsclip.engine.build import optimizer_offloaded
    from dsclip.engine.optim import build_optimizer

    o = make_run_config({"name": "t", "lr": 1e-2, "wd": 0.5, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6}).optim
    assert optimizer_offloaded({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert not optimizer_offloaded({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})
    assert not optimizer_offloaded({"zero_optimization": {"stage": 2}})
    models = [create_model("tiny") for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fast = build_optimizer(models[0], o, "cpu", cpu_offload=True)
    ref = build_optimizer(models[1], o, "cpu")
    assert isinstance(fast, DeepSpeedCPUAdam) and isinstance(ref, torch.optim.AdamW)
    assert [g["weight_decay"] for g in fast.param_groups] == [0.0, 0.5]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
            grad = torch.randn(p0.shape, generator=g)
            p0.grad, p1.grad = grad.clone(), grad.clone()
        fast.step()
        ref.step()
    for (n, p0), p1 in zip(models[0].named_parameters(), models[1].parameters()):
        # float32: |w| <= ~1 and each step moves a weight by <= ~lr, so rounding stays far below 1e-6
        torch.testing.assert_close(p0, p1, atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_odd_sized_parameters_go_last_in_their_group():
    """ZeRO flattens each group in this order; a tensor of 1 element (logit_scale) ahead of the others
    would put every later view off 16-byte alignment (dsclip.engine.optim.aligned_order)."""
    from dsclip.engine.optim import ALIGN_ELEMENTS

    model = create_model("tiny")
    names = {id(p): n for n, p in model.named_parameters()}
    plain = {id(p) for p in model.parameters()}
    for group in param_groups(model, 0.2):
        odd = [p.numel() % ALIGN_ELEMENTS != 0 for p in group["params"]]
        assert odd == sorted(odd), [names[id(p)] for p in group["params"]]  # all aligned sizes first
    ordered = [p for g in param_groups(model, 0.2) for p in g["params"]]
    assert {id(p) for p in ordered} == plain and len(ordered) == len(plain)
    assert names[id(param_groups(model, 0.2)[0]["params"][-1])] == "logit_scale"


def _flat_buffer_alignment(rank, world):
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config

    rc = make_run_config(
        {"name": "t", "model": "tiny", "batch_size": 2, "precision": "bf16", "deepspeed_config": "zero2_bf16"}
    )
    ds = resolve_ds_config(
        load_ds_json(rc.train.deepspeed_config), rc.train, rc.optim, world_size=world, device_type="cpu"
    )
    bundle = build_engine(ds, rc.train, rc.optim, lambda: create_model("tiny"), total_steps=10, steps_per_epoch=10)
    return [(n, p.data_ptr() % 16, p.numel()) for n, p in bundle.engine.module.named_parameters()]


def test_zero2_flat_buffer_views_are_16_byte_aligned():
    """Every parameter of a size that allows it starts on a 16-byte boundary inside ZeRO-2's flat bf16 buffer
    (cuBLAS picks alignment-1 kernels otherwise: a 2.4x slower step on an H200, bench/README.md)."""
    from dsclip.engine.optim import ALIGN_ELEMENTS
    from dsclip.testing.gloo_world import run_world

    (views,) = run_world(_flat_buffer_alignment, 1)
    misaligned = [(n, off) for n, off, numel in views if off and numel % ALIGN_ELEMENTS == 0]
    assert len(views) > 50 and not misaligned, misaligned


def test_checkpoints_of_another_parameter_order_resume_through_universal():
    from dsclip.checkpoint.universal import needs_universal
    from dsclip.engine.optim import PARAM_ORDER

    assert not needs_universal({"world_size": 2, "param_order": PARAM_ORDER}, 2)
    assert needs_universal({"world_size": 2, "param_order": PARAM_ORDER}, 4)
    assert needs_universal({"world_size": 2}, 2)  # written before the order had a version: flat state differs


def test_fused_adamw_equals_torch_adamw_to_rounding_and_stays_fused():
    """dsclip's AdamW on CPU (and CUDA) is torch's fused kernel over the flat ZeRO partition. After
    several steps its weights and moments must equal torch.optim.AdamW's default single-tensor path (what
    open_clip_train runs on CPU) to float32 rounding, for a partition-sized tensor, a matrix and a bias,
    with decay and without; the state_dicts load into each other, and a checkpoint written by another
    AdamW (its groups say fused=None/foreach=False, and loading copies that back) does not switch the
    kernel off."""
    import torch

    from dsclip.engine.optim import FusedAdamW, build_optimizer
    from tests.tolerances import worst_case

    o = make_run_config({"name": "t", "lr": 1e-2, "wd": 0.3, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6}).optim
    assert type(build_optimizer(create_model("tiny"), o, "cpu")) is FusedAdamW
    g = torch.Generator().manual_seed(0)
    shapes = [(3 * 4096 + 77,), (64, 33), (5,)]  # flat partition-like, a matrix, a bias
    init = [torch.randn(s, generator=g) for s in shapes]
    hyper = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6}
    steps = 6

    def make(cls, **kw):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [{"params": ps[:2], "weight_decay": 0.3}, {"params": ps[2:], "weight_decay": 0.0}]
        return ps, cls(groups, **hyper, **kw)

    ours_p, ours = make(FusedAdamW)
    ref_p, ref = make(torch.optim.AdamW, foreach=False)
    for _ in range(steps):
        for a, b in zip(ours_p, ref_p):
            grad = torch.randn(a.shape, generator=g) * 10 ** torch.randint(-4, 2, a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    # Each step rounds ~16 times per element (two moments, bias corrections, sqrt, eps, division, lr,
    # decay, update) on terms no larger than the weight plus the step's size. An Adam step is at most a
    # few lr per element (|m_hat| <= ~2 sqrt(v_hat) for beta1^2 < beta2; 4 lr taken), plus lr*wd*|w|.
    wd, lr = 0.3, hyper["lr"]
    differs = 0
    for a, b in zip(ours_p, ref_p):
        size = b.detach().abs() + steps * lr * (4 + wd * b.detach().abs())
        assert torch.all((a - b).abs() <= worst_case(16 * steps, 1.0) * size), (a - b).abs().max()
        for key in ("exp_avg", "exp_avg_sq"):
            m, r = ours.state[a][key], ref.state[b][key]
            assert torch.allclose(m, r, rtol=worst_case(8 * steps, 1.0), atol=0), key
        assert torch.equal(ours.state[a]["step"], ref.state[b]["step"])
        differs += int(not torch.equal(a, b))
    assert not torch.equal(ours_p[0], init[0])
    # interchangeable checkpoints: torch's AdamW continues from ours and vice versa, and ours stays fused
    ref_state = ref.state_dict()
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref_state)
    assert ours.param_groups[0]["fused"] is not True  # what loading did
    before = ours_p[0].detach().clone()
    ours_p[0].grad = torch.ones_like(before)
    ours.step()
    assert all(group["fused"] is True and group["foreach"] is None for group in ours.param_groups)
    assert not torch.equal(ours_p[0], before)
