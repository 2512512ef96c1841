"""LiT / partial locking on 2 gloo ranks under ZeRO-2 and ZeRO-3, with the gradient cache (K=2, and K=1 under
ZeRO-3, where the first step used to fail: dsclip/engine/input_grads.py) and activation checkpointing:
locked tensors are bit-for-bit unchanged after several steps, every unlocked one moved, locked parameters
have no optimizer state, and the unlocked gradients equal an independent single-process big-batch
reference with the same locking."""

from __future__ import annotations

import pytest
import torch

from dsclip.model import create_model  # noqa: F401  (imported before zero.Init patches torch.Tensor)
from dsclip.model.lock import LockConfig, apply_locking
from dsclip.testing.gloo_world import run_world
from dsclip.testing.gradcache import EPS, SEED, B, ds_json_path, make_batches, make_model, rank_chunks
from tests.dist.test_gradcache import grad_terms, reference_loss
from tests.tolerances import rounding

pytestmark = [pytest.mark.dist]
STEPS = 3
# image: only the projection trains; text: last block + ln_final and the projection train, and the
# LayerNorms of locked text layers stay trainable (--lock-text-freeze-layer-norm not given).
LOCK = LockConfig(lock_image=True, lock_image_unlocked_groups=1, lock_text=True, lock_text_unlocked_layers=2)


def _cfg(stage, K):
    from dsclip.config import make_run_config

    return make_run_config(
        {
            "name": "t",
            "batch_size": B,
            "accum_freq": K,
            "lr": 1e-3,
            "wd": 0.1,
            "warmup": 0,
            "lr_scheduler": "const",
            "precision": "fp32",
            "eps": EPS,
            "grad_checkpointing": True,
            "deepspeed_config": ds_json_path(stage),
        }
    )


def _full(p):
    """The whole tensor of a (possibly ZeRO-3 partitioned) parameter."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
    return p.detach().clone()


def _rank_steps(rank, world, stage, K):
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    cfg = _cfg(stage, K)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    counts = {}
    bundle = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        make_model,
        grad_checkpointing=cfg.model.grad_checkpointing,
        total_steps=10,
        steps_per_epoch=10,
        after_construction=lambda m: counts.update(apply_locking(m, LOCK)),
    )
    engine = bundle.engine
    params = dict(engine.module.named_parameters())
    locked = sorted(n for n, p in params.items() if not p.requires_grad)
    initial = {n: _full(p) for n, p in params.items()}
    step = GradCacheStep(engine, build_loss("infonce"))
    images, tokens = make_batches(world, K)
    grads = None
    for s in range(STEPS):
        torch.manual_seed(SEED + 17 * rank)
        engine.train()
        step(rank_chunks(images, tokens, rank, world, K), optimizer_step=False)
        if s == 0:
            grads = {n: safe_get_full_grad(p).clone() for n, p in params.items() if p.requires_grad}
        engine.step()
    final = {n: _full(p) for n, p in params.items()}
    # optimizer state exists only for trainable parameters (ZeRO pads partitions by a few elements)
    state_numel = sum(int(st["exp_avg"].numel()) for st in engine.optimizer.optimizer.state.values() if "exp_avg" in st)
    t = torch.tensor([state_numel])
    dist.all_reduce(t)
    return {
        "locked": locked,
        "initial": initial,
        "final": final,
        "grads": grads,
        "counts": counts,
        "state_numel": int(t.item()),
        "patches": list(bundle.patches.active),
    }


def reference_grads(initial, world, K):
    """One process, the whole W·K·B batch, the same locking; dropout-free so no mask replay is needed."""
    model = make_model()
    model.load_state_dict(initial)
    apply_locking(model, LOCK)
    model.train()
    images, tokens = make_batches(world, K)
    out = model(image=images, text=tokens)
    reference_loss(out["image_features"], out["text_features"], out["logit_scale"]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,K", [(2, 2), (3, 2), (3, 1)])
def test_locked_towers_zero_world2_gradcache_checkpointing(stage, K):
    results = run_world(_rank_steps, 2, stage, K)
    r = results[0]
    locked = set(r["locked"])
    names = set(r["initial"])
    # the groups OpenCLIP's lock() would lock: image all but proj; text embeddings + block 0 (LNs excepted)
    assert "visual.proj" not in locked and "visual.pos_embed" in locked and "visual.blocks.1.mlp.fc1.weight" in locked
    assert "text.token_embedding.weight" in locked and "text.blocks.0.attn.qkv.weight" in locked
    assert "text.blocks.0.norm1.weight" not in locked and "text.blocks.1.attn.qkv.weight" not in locked
    assert "logit_scale" not in locked
    # ZeRO-3 with frozen parameters: the trainable modules' inputs require grad (engine/input_grads.py), so the
    # gradient cache's two fetch traces (patches/zero3_traces) run here too
    assert ("zero3_traces" in r["patches"]) == (stage == 3)
    c = r["counts"]
    assert c["locked"] == sum(r["initial"][n].numel() for n in locked) and c["trainable"] + c["locked"] == c["total"]
    for res in results:
        for n in names:
            if n in locked:
                assert torch.equal(res["final"][n], res["initial"][n]), f"locked {n} changed"
            else:
                assert not torch.equal(res["final"][n], res["initial"][n]), f"unlocked {n} did not move"
        assert c["trainable"] <= res["state_numel"] <= c["trainable"] + 64, (res["state_numel"], c)
    ref = reference_grads(r["initial"], 2, K)
    for n in names:
        if n in locked:
            assert ref[n] is None
            continue
        gtol = rounding(grad_terms(2, K), float(ref[n].abs().max()))  # as tests/dist/test_gradcache.py
        for res in results:
            torch.testing.assert_close(res["grads"][n], ref[n], atol=gtol, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
