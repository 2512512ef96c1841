"""One rank, ZeRO-1/2: dsclip's one-copy gradient flush against DeepSpeed's own coalesced flush.

dsclip/engine/local_flush.py replaces DeepSpeed's bucketed reduction (over a world of one) by one
copy of every ``.grad`` into a flat buffer that ``step()`` reads as its pre-flattened partition. It
moves the same numbers, so everything must be bit for bit what DeepSpeed's flush gives: the
gradients (``safe_get_full_grad``), the gradient norm, the weights and the Adam moments after each
of several steps (the buffer is reused across steps), for ZeRO-1 and ZeRO-2. The big-batch
reference test (test_gradcache.py, world 1) covers the same path against an independent computation.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.test_gradcache import make_batches, make_cfg, make_model, rank_chunks
from tests.distutil import run_world

pytestmark = [pytest.mark.dist]
K, STEPS = 3, 3


def _run(rank, world, stage, local):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_cfg(stage, K)
    cfg.optim.grad_clip_norm = 0.05  # clipping rescales the flat buffer in place: covered too
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    engine = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10).engine
    step = GradCacheStep(engine, build_loss("infonce"), local_flush=local)
    named = list(engine.module.named_parameters())
    out = {"local_flush": step.local_flush, "grads": [], "norms": [], "weights": [], "exp_avg_sq": []}
    for s in range(STEPS):
        images, tokens = make_batches(world, K, seed=100 + s)
        torch.manual_seed(7 + s)
        engine.train()
        step(rank_chunks(images, tokens, rank, world, K), optimizer_step=False)
        out["grads"].append({n: safe_get_full_grad(p).clone() for n, p in named})
        engine.step()
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["weights"].append({n: safe_get_full_fp32_param(p).clone() for n, p in named})
        # one rank: the torch optimizer's state holds the whole flat fp32 partition of each group
        state = engine.optimizer.optimizer.state
        out["exp_avg_sq"].append({i: st["exp_avg_sq"].clone() for i, st in enumerate(state.values())})
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_local_flush_is_bitwise_deepspeeds_flush(stage):
    (ours,) = run_world(_run, 1, stage, True)
    (theirs,) = run_world(_run, 1, stage, False)
    assert ours["local_flush"] and not theirs["local_flush"]
    assert ours["norms"] == theirs["norms"] and all(n > 0.05 for n in ours["norms"])  # clipping was active
    for key in ("grads", "weights", "exp_avg_sq"):
        for s in range(STEPS):
            diff = [n for n in ours[key][s] if not torch.equal(ours[key][s][n], theirs[key][s][n])]
            assert not diff, f"step {s}: {key} differ for {diff}"
    # the steps moved the weights (the comparison is not between two untouched models)
    assert any(not torch.equal(ours["weights"][0][n], ours["weights"][-1][n]) for n in ours["weights"][0])
