"""The gradient norm only on the steps that report it (dsclip/engine/patches/grad_norm.py), at two ranks.

Without clipping, ``GradCacheStep(..., grad_norm=False)`` runs ZeRO-2's step without the global norm.
Against the same steps with the norm, bit for bit: the weights after every step (the norm changes no
update when nothing is clipped), the norm of the step that asks for it; None where skipped. In fp32
DeepSpeed skips a step whose norm is inf/NaN; without the norm, the inf/NaN check must skip it instead,
on every rank (an inf gradient element is planted on rank 0 at step 1). With clipping the norm is
computed whatever the caller says. bf16: its overflow check runs either way (DeepSpeed's default).
"""

from __future__ import annotations

import pytest
import torch

from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import make_batches, make_cfg, make_model, rank_chunks

pytestmark = [pytest.mark.dist]
K, STEPS = 2, 3
# (precision, clip, which steps report the norm)
CASES = [
    ("fp32", 0.0, (True, True, True)),  # the reference: DeepSpeed's norm on every step
    ("fp32", 0.0, (False, False, True)),
    ("fp32", 0.05, (False, False, True)),  # clipping needs the norm: computed on every step anyway
    ("bf16", 0.0, (True, True, True)),
    ("bf16", 0.0, (False, False, True)),
]


def _run_cases(rank, world):
    return [_run(rank, world, *case) for case in CASES]


def _run(rank, world, precision, clip, report):
    from deepspeed.utils import safe_get_full_fp32_param

    from dsclip.engine.build import autocast_dtype, build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    # the coalesced reduction, where the inf is planted (its flush); in bf16 at one chunk a step: K > 1 chunks
    # summed in bf16 are refused, by GradCacheStep as by dsclip train (issue 64)
    k = K if precision == "fp32" else 1
    cfg = make_cfg(2, k)
    cfg.optim.grad_clip_norm = clip
    cfg.train.engine_patches = "all,+grad_norm"  # opt-in (dsclip/engine/patches/__init__.py OPT_IN)
    if precision == "bf16":
        cfg.train.precision, cfg.train.deepspeed_config = "bf16", "ds_configs/zero2_bf16.json"
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    bundle = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10)
    engine = bundle.engine
    step = GradCacheStep(
        engine, build_loss("infonce"), accum_freq=k, grad_reduction="coalesced", compute_dtype=autocast_dtype(bundle)
    )

    planting = {"now": False}
    flush = engine._flush_coalesced_reduction_zero12

    def flush_then_plant(optimizer):  # the reduced gradient of rank 0 gets one inf element at step 1
        flush(optimizer)
        if planting["now"]:
            optimizer.averaged_gradients[0][-1].view(-1)[0] = float("inf")

    engine._flush_coalesced_reduction_zero12 = flush_then_plant
    named = list(engine.module.named_parameters())
    from dsclip.engine.patches import active_patches

    out = {"optional": "grad_norm" in active_patches(engine), "applied": [], "norms": []}
    out["weights"] = []
    for s in range(STEPS):
        images, tokens = make_batches(world, k, seed=100 + s)
        torch.manual_seed(7 + s)
        engine.train()
        planting["now"] = s == 1 and rank == 0
        result = step(rank_chunks(images, tokens, rank, world, k), grad_norm=report[s])
        out["applied"].append(result.applied)
        out["norms"].append(result.grad_norm)
        out["weights"].append({n: safe_get_full_fp32_param(p).clone() for n, p in named})
    # the switches are back as DeepSpeed had them after every step
    out["switches"] = (engine.optimizer.compute_grad_norm, engine.optimizer.check_grad_overflow)
    return out


def test_norm_skipped_where_not_reported_same_weights_inf_still_skips():
    ranks = run_world(_run_cases, 2)
    results = {case: [r[i] for r in ranks] for i, case in enumerate(CASES)}
    for precision, clip, report in CASES:
        case = f"{precision}, clip {clip}, norm reported {report}"
        reference = results[(precision, clip, (True,) * STEPS)] if clip == 0 else None
        for r, out in enumerate(results[(precision, clip, report)]):
            assert out["optional"] == (clip == 0), case
            assert out["switches"] == (True, precision == "bf16"), case
            # step 1 carries the planted inf on rank 0: skipped on every rank, with or without the norm
            assert out["applied"] == [True, False, True], f"{case}, rank {r}"
            for s in range(STEPS):
                if report[s] or clip > 0:
                    assert out["norms"][s] is not None, f"{case}, step {s}"
                    assert s == 1 or 0 < out["norms"][s] < float("inf"), f"{case}, step {s}"
                else:
                    assert out["norms"][s] is None, f"{case}, step {s}: the norm was computed"
            if reference is None:
                continue
            ref = reference[r]
            assert out["norms"][-1] == ref["norms"][-1], case
            for s in range(STEPS):
                diff = [n for n in ref["weights"][s] if not torch.equal(out["weights"][s][n], ref["weights"][s][n])]
                assert not diff, f"{case}, rank {r}, step {s}: weights differ for {diff}"
        # the steps moved the weights
        w = results[(precision, clip, report)][0]["weights"]
        assert any(not torch.equal(w[0][n], w[-1][n]) for n in w[0]), case
