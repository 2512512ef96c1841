"""zero3_blocks (dsclip/engine/patches/zero3_blocks.py), with zero3_forward_flags on top of it, in a real
two-rank ZeRO-3 engine against DeepSpeed's own hooks on the leaf blocks and its own per-forward module walk.

The same run twice, each in a world of its own: ``--engine-patches all`` and ``all,-zero3_blocks`` (DeepSpeed's
four per-module hooks on each block and, since zero3_forward_flags needs zero3_blocks, DeepSpeed's walk: the
reference). The persistence threshold is lowered so that the tiny
model's matrices are gathered per block and its vectors stay whole (the shipped 1e5 keeps every tensor of
this model whole and there would be nothing to gather). Four cases:

- ``gradcache``: K = 2 (no-grad forwards, then forward + backward per chunk), with an evaluation forward of
  the whole model and one of the image tower alone (outside the root forward: a unit that departs from its
  record) between the steps;
- ``limits``: K = 1 with a reuse distance and a live limit of about one block, so blocks are released
  between their forward and their backward and the prefetch stops at the limit;
- ``locked``: the image tower frozen (LiT's --lock-image; dsclip's input-grad hooks make the patch apply);
- ``checkpointed``: K = 2 with every block checkpointed (each block's forward recomputed in its backward).

Each checks that gradients, fp32 weights and Adam's moments are bit for bit DeepSpeed's after every step,
that the patch ran (gathers, prefetches, releases at each of its places), and that after every step no
block is left gathered or in flight.
"""

from __future__ import annotations

import pytest
import torch

from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import make_batches, make_cfg, make_model, rank_chunks
from tests.dist.test_local_flush import same_bits

pytestmark = [pytest.mark.dist]
STEPS, WORLD = 3, 2
PERSISTENCE_THRESHOLD = 1000  # below the tiny model's matrices (>= 4096 elements), above its vectors
CASES = {
    "gradcache": {"k": 2, "zero": {}, "lock_image": False, "evaluate": True},
    # one tiny block gathers 49,152 elements: a distance of about one block and a limit of about two
    "limits": {
        "k": 1,
        "zero": {"stage3_max_reuse_distance": 60_000, "stage3_max_live_parameters": 120_000},
        "lock_image": False,
        "evaluate": False,
    },
    "locked": {"k": 2, "zero": {}, "lock_image": True, "evaluate": False},
    # every block checkpointed (bigG's configuration): its forward recomputed inside its backward
    "checkpointed": {"k": 2, "zero": {}, "lock_image": False, "evaluate": False, "checkpointing": True},
}


def locked_image_model():
    model = make_model()
    model.visual.requires_grad_(False)
    return model


def _run(rank, world, patches, case):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, z3_leaf_module

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    spec = CASES[case]
    k = spec["k"]
    cfg = make_cfg(3, k)
    cfg.train.engine_patches = patches
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    ds["zero_optimization"].update(spec["zero"])
    factory = locked_image_model if spec["lock_image"] else make_model
    bundle = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        factory,
        total_steps=10,
        steps_per_epoch=10,
        grad_checkpointing=spec.get("checkpointing", False),
    )
    engine = bundle.engine
    step = GradCacheStep(engine, build_loss("infonce"), accum_freq=k)
    named = list(engine.module.named_parameters())
    block_params = [p for m in engine.module.modules() if z3_leaf_module(m) for p in m.parameters() if not p.ds_persist]
    hooks = getattr(engine.optimizer.parameter_offload, "dsclip_block_hooks", None)
    out = {"active": "zero3_blocks" in bundle.patches.active, "grads": [], "weights": [], "exp_avg": []}
    # zero3_forward_flags: plain dicts inside the blocks, the recorded flags set during each forward only
    out["flags_active"] = "zero3_forward_flags" in bundle.patches.active
    inside = [m for b in engine.module.modules() if z3_leaf_module(b) for m in b.modules()]
    out["plain_inside"] = all(type(m._parameters) is dict for m in inside)
    # DeepSpeed's gradient-reduction hook: torch's full backward hook on each trainable block, or called by ours
    out["full_backward_hooks"] = sum(len(b._backward_hooks) for b in engine.module.modules() if z3_leaf_module(b))
    out["trainable_blocks"] = sum(
        any(p.requires_grad for p in b.parameters()) for b in engine.module.modules() if z3_leaf_module(b)
    )
    flags = getattr(engine, "dsclip_forward_flags", [])
    seen_in_forward = []  # (through the engine's forward, flags all set), at each image-tower forward
    through_engine = [True]
    engine.module.visual.register_forward_pre_hook(
        lambda m, a: seen_in_forward.append((through_engine[0], bool(flags) and all(d._in_forward for d in flags)))
    )
    out["left_gathered"] = []
    out["blocks"] = sum(1 for m in engine.module.modules() if z3_leaf_module(m))
    for s in range(STEPS):
        images, tokens = make_batches(world, k, seed=500 + s)
        torch.manual_seed(7 + s)
        engine.train()
        step(rank_chunks(images, tokens, rank, world, k), optimizer_step=False)
        grads = {n: safe_get_full_grad(p) for n, p in named if p.requires_grad}
        out["grads"].append({n: g.clone() for n, g in grads.items() if g is not None})
        engine.step()
        out["weights"].append({n: safe_get_full_fp32_param(p).clone() for n, p in named if p.requires_grad})
        state = engine.optimizer.optimizer.state
        out["exp_avg"].append({i: st["exp_avg"].clone() for i, st in enumerate(state.values())})
        out["left_gathered"].append(sum(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in block_params))
        if spec["evaluate"]:
            engine.eval()
            im, tk = rank_chunks(images, tokens, rank, world, k)[0]
            with torch.no_grad():
                out.setdefault("eval", []).append(engine(im, tk)["image_features"].clone())
                through_engine[0] = False
                out["eval"].append(engine.module.encode_image(im).clone())  # not through the root forward
                through_engine[0] = True
            out["left_gathered"].append(sum(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in block_params))
    out["flags_in_forward"] = seen_in_forward
    out["flags_after"] = any(d._in_forward for d in flags)
    if hooks is not None:
        hooks.settle()
        out["counts"] = dict(hooks.counts)
        out["held_after"] = hooks.held
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_zero3_blocks_compute_what_deepspeeds_hooks_compute(case):
    ours_all = run_world(_run, WORLD, "all", case)
    theirs_all = run_world(_run, WORLD, "all,-zero3_blocks", case)
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        assert ours["active"] and not theirs["active"]
        assert ours["flags_active"] and not theirs["flags_active"]  # it needs zero3_blocks
        assert ours["plain_inside"] and not theirs["plain_inside"]
        assert ours["full_backward_hooks"] == 0 and theirs["full_backward_hooks"] == theirs["trainable_blocks"] > 0
        # ... called by ours once per trainable block's backward: K forward+backward units a step
        units = STEPS * CASES[case]["k"]
        assert ours["counts"]["reduced"] == units * ours["trainable_blocks"], ours["counts"]
        # set in the engine's forwards, not in a tower's forward called directly (nor are DeepSpeed's), not after
        assert ours["flags_in_forward"] and all(engine == flagged for engine, flagged in ours["flags_in_forward"])
        assert not ours["flags_after"]
        counts = ours["counts"]
        assert counts["gathers"] > 0 and counts["prefetched"] > 0, counts
        assert counts["released_backward"] > 0, counts
        if CASES[case]["k"] > 1 or CASES[case]["lock_image"]:
            assert counts["released_forward"] > 0, counts  # no-grad forwards, frozen blocks
        if case == "limits":
            # after the recording step (which releases after every forward), blocks are still released between
            # their forward and their backward (the distance) and gathered again for the backward
            blocks = ours["blocks"]
            assert counts["released_forward"] > blocks and counts["gathers"] + counts["prefetched"] > STEPS * blocks
        if case == "checkpointed":  # every block of the forward+backward units recomputed once
            assert counts["recomputes"] == STEPS * CASES[case]["k"] * ours["blocks"], counts
        else:
            assert counts.get("recomputes", 0) == 0, counts
        if case == "gradcache":
            assert counts.get("deviations", 0) >= 1  # the image tower's forward outside a root forward
        else:
            assert counts.get("deviations", 0) == 0, counts
        assert ours["held_after"] == 0
        assert all(n == 0 for n in ours["left_gathered"]), ours["left_gathered"]
        for s in range(STEPS):
            for key in ("grads", "weights", "exp_avg"):
                a, b = ours[key][s], theirs[key][s]
                assert a.keys() == b.keys() and a
                diff = [n for n in a if not same_bits(a[n], b[n])]
                assert not diff, f"{case}: step {s}: {key} differ for {diff}"
        for a, b in zip(ours.get("eval", []), theirs.get("eval", []), strict=True):
            assert same_bits(a, b)
