"""One rank, fp32: AdamW on the gradients where backward left them (dsclip/engine/single_rank_step.py)
against DeepSpeed's own flush and ZeRO-2 step.

Both engines are built from the same seed and take the same steps over the same batches: plain steps, steps
without the norm (DeepSpeed's inf/NaN check instead, dsclip/engine/grad_norm.py), a step with an inf
gradient element (skipped by the check), a step with a NaN element and the norm on (skipped by the invalid
norm), steps with clipping active, a checkpoint saved and loaded in between, after which the moments are new
tensors (as torch's ``load_state_dict`` leaves them; the step must update those) and the master weights no
longer the model's own (the step must copy them back), and a parameter the forward never uses (stepped with
a zero gradient: weight decay only). After every step: applied or not, the norm, every weight, the Adam
moments and the step count. The first step creates the optimizer state through DeepSpeed's own step (bit for
bit DeepSpeed's); the later ones differ from it only in rounding: the fused kernel rounds the last elements
of each tensor in its scalar loop, and the norm sums its float64 squares in another order.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_gradcache import LR, make_batches, make_cfg, make_model, rank_chunks
from tests.distutil import run_world
from tests.tolerances import unit_roundoff

pytestmark = [pytest.mark.dist]
K = 2
# (grad_norm, poison) per step: poison puts inf/nan into one gradient element after the flush
PLAN = [(True, None), (False, None), (False, "inf"), (True, "nan"), (False, None), (True, None)]
SAVE_AFTER = 3  # checkpoint saved and loaded after this step (the next steps use the loaded state)


def _model_with_unused_parameter():
    model = make_model()
    # 2-D: in the decayed group. Nothing reads it: no gradient, so only weight decay moves it.
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(4, 8)))
    return model


def _engine_and_step(world, k=1, model=make_model, precision="fp32", **options):
    """A ZeRO-2 engine on the tiny model and its GradCacheStep (``options``: config overrides by section
    attribute, ``optim.*`` / ``train.*``, and GradCacheStep keywords)."""
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_cfg(2, k)
    cfg.train.precision, cfg.train.deepspeed_config = precision, f"ds_configs/zero2_{precision}.json"
    for key in [k for k in options if k.startswith(("optim.", "train."))]:
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, options.pop(key))
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    engine = build_engine(ds, cfg.train, cfg.optim, model, total_steps=10, steps_per_epoch=10).engine
    return engine, GradCacheStep(engine, build_loss("infonce"), **options)


def _run(rank, world, tmp, clip):
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for mode in ("single_rank", "deepspeed"):
        engine, step = _engine_and_step(
            world,
            K,
            _model_with_unused_parameter,
            **{"optim.grad_clip_norm": clip},
            local_flush=mode == "single_rank",
            fast_overflow_check=mode == "single_rank",
        )
        named = list(engine.module.named_parameters())
        rec = {"installed": step.single_rank_step, "applied": [], "norms": [], "weights": [], "moments": []}
        rec["grads"], rec["steps"], rec["in_place"] = [], [], []
        for s, (grad_norm, poison) in enumerate(PLAN):
            images, tokens = make_batches(world, K, seed=300 + s)
            torch.manual_seed(11 + s)
            engine.train()
            step(rank_chunks(images, tokens, rank, world, K), optimizer_step=False)
            rec["grads"].append({n: safe_get_full_grad(p).clone() for n, p in named})
            held = engine.optimizer.averaged_gradients[0]
            rec["in_place"].append(type(held).__name__)
            if poison:
                held[0].view(-1)[0] = float(poison)
            if not grad_norm and clip == 0:  # as GradCacheStep does on a step whose norm nobody reads
                from dsclip.engine.grad_norm import without_grad_norm

                with without_grad_norm(engine.optimizer):
                    engine.step()
            else:
                engine.step()
            rec["applied"].append(bool(engine.was_step_applied()))
            norm = engine.get_global_grad_norm()
            rec["norms"].append(None if norm is None else float(norm))
            rec["weights"].append({n: p.detach().clone() for n, p in named})
            state = engine.optimizer.optimizer.state
            rec["moments"].append([(st["exp_avg"].clone(), st["exp_avg_sq"].clone()) for st in state.values()])
            rec["steps"].append([float(st["step"]) for st in state.values()])
            if s == SAVE_AFTER:
                saved = [st["exp_avg_sq"].clone() for st in state.values()]
                engine.save_checkpoint(f"{tmp}/{mode}-{clip}", tag="t")
                for st in state.values():
                    st["exp_avg_sq"].zero_()
                engine.load_checkpoint(f"{tmp}/{mode}-{clip}", tag="t")
                state = engine.optimizer.optimizer.state  # the load may give the optimizer a new state dict
                rec["loaded"] = all(torch.equal(a, st["exp_avg_sq"]) for a, st in zip(saved, state.values()))
                # DeepSpeed copies the loaded moments into the tensors it has; torch's own load_state_dict
                # puts new ones in their place: the step must then update those
                for st in state.values():
                    st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
                # and a master with storage of its own (no longer the model's flat weights): the step must still
                # move the model's weights
                for master in engine.optimizer.single_partition_of_fp32_groups:
                    master.data = master.data.clone()
        out[mode] = rec
    return out


def _close(a, b, *, steps, scale):
    """Rounding of the fused kernel's per-tensor tails and of the norm: a few units in the last place per
    step, relative to the value, plus the same relative to the update's own size (lr)."""
    u = unit_roundoff()
    return torch.allclose(a, b, rtol=8 * u * steps, atol=8 * u * steps * scale)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_single_rank_step_matches_deepspeeds_step(tmp_path, clip):
    res = run_world(_run, 1, str(tmp_path), clip)[0]
    ours, theirs = res["single_rank"], res["deepspeed"]
    assert ours["installed"] and not theirs["installed"]
    # the first step (no optimizer state yet) goes through DeepSpeed's step with the flat buffer, the
    # others hand the step the gradients themselves
    assert ours["in_place"] == ["_FlatGrads"] + ["_ParamGrads"] * (len(PLAN) - 1)
    assert ours["loaded"] and theirs["loaded"]
    poisoned = [p is not None for _, p in PLAN]
    assert ours["applied"] == theirs["applied"] == [not p for p in poisoned]
    for s, (grad_norm, _) in enumerate(PLAN):
        case = f"clip {clip}, step {s}"
        for n in ours["grads"][s]:  # what safe_get_full_grad reads between the flush and the step
            assert torch.equal(ours["grads"][s][n], theirs["grads"][s][n]), f"{case}: gradient {n}"
        computed = grad_norm or clip > 0
        if poisoned[s]:
            assert ours["norms"][s] == theirs["norms"][s] == (float("inf") if computed else None), case
        elif computed:
            assert ours["norms"][s] == pytest.approx(theirs["norms"][s], rel=4 * unit_roundoff()), case
            if clip:
                assert ours["norms"][s] > clip, f"{case}: clipping was not active"
        else:
            assert ours["norms"][s] is None and theirs["norms"][s] is None, case
        assert ours["steps"][s] == theirs["steps"][s], case
        for n in ours["weights"][s]:
            a, b = ours["weights"][s][n], theirs["weights"][s][n]
            if s == 0:
                assert torch.equal(a, b), f"{case}: {n} (DeepSpeed's own step)"
            assert _close(a, b, steps=s + 1, scale=LR), f"{case}: weight {n}, max diff {(a - b).abs().max()}"
        for (m1, v1), (m2, v2) in zip(ours["moments"][s], theirs["moments"][s], strict=True):
            assert _close(m1, m2, steps=s + 1, scale=float(m2.abs().max())), f"{case}: exp_avg"
            assert _close(v1, v2, steps=s + 1, scale=float(v2.abs().max())), f"{case}: exp_avg_sq"
        if poisoned[s]:  # a skipped step leaves the weights where they were
            prev = ours["weights"][s - 1]
            assert all(torch.equal(ours["weights"][s][n], prev[n]) for n in prev), case
    # the steps moved the weights, and the parameter nobody reads only decayed
    first, last = ours["weights"][0], ours["weights"][-1]
    assert any(not torch.equal(first[n], last[n]) for n in first)
    assert (last["unused"] < first["unused"]).all() and (last["unused"] > 0.99).all()


def _install(rank, world, precision, opt, single_rank_step):
    engine, step = _engine_and_step(world, precision=precision, **{"optim.opt": opt}, single_rank_step=single_rank_step)
    return step.single_rank_step, getattr(engine, "_dsclip_single_rank_step", False)


@pytest.mark.parametrize(
    "world, precision, opt, asked, expected",
    [
        (1, "fp32", "adamw", True, True),
        (1, "fp32", "adamw", False, False),  # the flat step, on request (the reference in bench/)
        (1, "bf16", "adamw", True, False),  # the fp32 master is a copy of the bf16 weights: the flat step
        (1, "fp32", "timm/lion", True, False),  # not torch's fused AdamW
        (2, "fp32", "adamw", True, False),  # a partition and a reduction to do
    ],
)
def test_single_rank_step_only_where_it_applies(world, precision, opt, asked, expected):
    for flag, installed in run_world(_install, world, precision, opt, asked):
        assert flag == installed == expected


def _supported_by_device(rank, world):
    from dsclip.engine.single_rank_step import single_rank_step_supported

    engine, _ = _engine_and_step(world, single_rank_step=False)  # the flat flush, the master aliased
    opt = engine.optimizer
    on_cpu = single_rank_step_supported(engine)
    flats = opt.bit16_groups_flat
    opt.bit16_groups_flat = [t.to("meta") for t in flats]  # stands in for buffers on a GPU (no GPU here)
    try:
        elsewhere = single_rank_step_supported(engine)
    finally:
        opt.bit16_groups_flat = flats
    return on_cpu, elsewhere


def test_single_rank_step_is_for_cpu_ranks():
    """On a GPU the flat copy is one device memcpy and the per-tensor check and norm would be hundreds of
    launches: the flat step stays there (the device type is the only difference here)."""
    on_cpu, elsewhere = run_world(_supported_by_device, 1)[0]
    assert on_cpu and not elsewhere
