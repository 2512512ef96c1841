"""--grad-checkpointing goes through DeepSpeed's activation checkpointing, configured by the JSON block.

DeepSpeed only applies ``activation_checkpointing`` when the code calls
``deepspeed.checkpointing.configure`` and checkpoints through ``deepspeed.checkpointing``: these tests
show blocks really are recomputed in backward, that the JSON settings reach DeepSpeed, and that
gradients (dropout on) are unchanged by checkpointing.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsclip.model import create_model, get_model_config  # before zero.Init patches torch.Tensor
from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]
B = 4


def _model():
    cfg = get_model_config("tiny")
    for tower in ("vision_cfg", "text_cfg"):
        cfg[tower].update(dropout=0.1, attn_dropout=0.1)
    torch.manual_seed(0)
    return create_model(cfg, vocab_size=256, eos_id=2, pad_id=0)


def _engine(tmp, stage, checkpointing, profile):
    from dsclip.config import make_run_config
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config

    raw = load_ds_json(f"ds_configs/zero{stage}_fp32.json")
    raw["activation_checkpointing"]["profile"] = profile
    if stage == 3:  # partition every parameter (the tiny model's would all stay persistent otherwise)
        raw["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = f"{tmp}/ds_{checkpointing}_{profile}.json"
    with open(path, "w") as f:
        json.dump(raw, f)
    cfg = make_run_config(
        {
            "name": "t",
            "batch_size": B,
            "precision": "fp32",
            "deepspeed_config": path,
            "grad_checkpointing": checkpointing,
            "warmup": 0,
        }
    )
    ds = resolve_ds_config(load_ds_json(path), cfg.train, cfg.optim, world_size=1, device_type="cpu")
    return build_engine(
        ds,
        cfg.train,
        cfg.optim,
        _model,
        grad_checkpointing=cfg.model.grad_checkpointing,
        total_steps=1,
        steps_per_epoch=1,
    ).engine


def _counting(forward, calls):
    def wrapped(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    return wrapped


def _one_step(rank, world, tmp, stage, profile):
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt
    from deepspeed.utils import safe_get_full_grad

    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    g = torch.Generator().manual_seed(1)
    images = torch.randn(B, 3, 32, 32, generator=g)
    tokens = torch.randint(3, 200, (B, 32), generator=g)
    out = {}
    for checkpointing in (False, True):
        engine = _engine(tmp, stage, checkpointing, profile)
        # Count calls of each block's forward (module hooks do not fire during torch's recomputation).
        calls = {"n": 0}
        for blk in list(engine.module.visual.blocks) + list(engine.module.text.blocks):
            blk.forward = _counting(blk.forward, calls)
        torch.manual_seed(123)
        engine.train()
        GradCacheStep(engine, build_loss("infonce"))([(images, tokens)], optimizer_step=False)
        out[checkpointing] = {
            "block_forwards": calls["n"],
            "grads": {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()},
            "profile_flag": ds_ckpt.PROFILE_TIME,
            "configured": ds_ckpt.is_configured(),
        }
    return out


@pytest.mark.parametrize("stage,profile", [(2, False), (3, True)])
def test_blocks_recomputed_and_gradients_unchanged(tmp_path, stage, profile):
    (res,) = run_world(_one_step, 1, str(tmp_path), stage, profile)
    tiny = get_model_config("tiny")
    n_blocks = tiny["vision_cfg"]["layers"] + tiny["text_cfg"]["layers"]
    plain, ckpt = res[False], res[True]
    assert plain["block_forwards"] == n_blocks  # one forward per block (K=1 keeps the pass-1 graph)
    assert ckpt["block_forwards"] == 2 * n_blocks  # ...plus a recompute of every block in backward
    assert ckpt["configured"] and ckpt["profile_flag"] is profile  # the JSON block reached DeepSpeed
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(ckpt["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
