"""The gradient cache against an independent single-process big-batch reference (gloo, CPU, fp32).

For world W, accum K and micro-batch B, one dsclip step sees W·K·B samples. The reference builds
the same model from the same seed in one process, runs the whole W·K·B batch through it with a
plain N×N InfoNCE written here, and takes one AdamW step. Every parameter's gradient (gathered from
the ZeRO shards with safe_get_full_grad) and every updated weight must match.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsclip.model import (
    create_model,
    get_model_config,
)  # imported before zero.Init patches torch.Tensor (timm -> dynamo)
from tests.distutil import run_world

B, SEED = 4, 1234
# Adam's first step moves each weight by lr·g/(|g|+eps): with eps 1e-6 a 1e-9 float32 summation-order
# difference in a near-zero gradient moves a weight by 1e-6. eps 1e-4 keeps the weight check at 1e-6
# meaningful (sensitivity lr/eps = 10) without hiding real gradient errors, which the grad check sees.
EPS = 1e-4
pytestmark = [pytest.mark.dist]


def reference_loss(img, txt, scale):
    logits = scale * img @ txt.T  # (N, N)
    labels = torch.arange(img.shape[0])
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


def make_batches(world, k, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(world * k * B, 3, 32, 32, generator=g)
    tokens = torch.randint(3, 200, (world * k * B, 32), generator=g)
    tokens[:, 20] = 2  # EOS; pooling is 'eos' with eos_id 2
    tokens[:, 21:] = 0
    return images, tokens


def rank_chunks(images, tokens, rank, world, k):
    """Rank r's K micro-batches: a contiguous block of the global batch."""
    per_rank = k * B
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    im, tk = images[sl], tokens[sl]
    return [(im[i * B : (i + 1) * B], tk[i * B : (i + 1) * B]) for i in range(k)]


def make_model(patch_dropout=0.0):
    """The tiny model; with patch dropout we also switch on dropout, attention dropout and drop-path."""
    cfg = get_model_config("tiny")
    if patch_dropout:
        for tower in ("vision_cfg", "text_cfg"):
            cfg[tower].update(dropout=0.1, attn_dropout=0.1, drop_path_rate=0.2)
    torch.manual_seed(SEED)
    return create_model(cfg, vocab_size=256, eos_id=2, pad_id=0, patch_dropout=patch_dropout or None)


def ds_json_path(stage) -> str:
    """Shipped JSON for ZeRO-2/3; derived ones (written to a temp dir) for ZeRO-0/1 and ZeRO-2/3 offload."""
    import json
    import tempfile

    if stage in (2, 3):
        return f"ds_configs/zero{stage}_fp32.json"
    raw = json.loads(open("ds_configs/zero3_fp32.json" if stage == "3off" else "ds_configs/zero2_fp32.json").read())
    if stage in ("2off", "3off"):
        raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == "3off":
            raw["zero_optimization"]["offload_param"] = {"device": "cpu"}
    else:
        raw["zero_optimization"] = {"stage": stage}
    path = tempfile.NamedTemporaryFile("w", suffix=f"_zero{stage}.json", delete=False).name
    with open(path, "w") as f:
        json.dump(raw, f)
    return path


def make_cfg(stage, k, lr=1e-3, compile_backend=None):
    from dsclip.config import make_run_config

    compile_values = {"torchcompile": True, "torchcompile_backend": compile_backend} if compile_backend else {}
    return make_run_config(
        {
            **compile_values,
            "name": "t",
            "batch_size": B,
            "accum_freq": k,
            "lr": lr,
            "wd": 0.1,
            "warmup": 0,
            "lr_scheduler": "const",
            "precision": "fp32",
            "eps": EPS,
            "deepspeed_config": ds_json_path(stage),
        }
    )


def _rank_step(rank, world, stage, k, reduction, patch_dropout, keep_last, compile_backend=None):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_cfg(stage, k, compile_backend=compile_backend)
    ds = resolve_ds_config(load_ds_json(cfg.train.deepspeed_config), cfg, world_size=world, device_type="cpu")
    bundle = build_engine(cfg, ds, lambda: make_model(patch_dropout), total_steps=10, steps_per_epoch=10)
    engine = bundle.engine

    def full_param(p):  # ZeRO-0 keeps plain fp32 parameters: DeepSpeed's accessor returns None there
        v = safe_get_full_fp32_param(p)
        return (p.detach() if v is None else v).clone()

    initial = {n: full_param(p) for n, p in engine.module.named_parameters()}
    step = GradCacheStep(engine, build_loss("infonce"), keep_last_graph=keep_last, reduction=reduction)
    images, tokens = make_batches(world, k)
    torch.manual_seed(SEED + 17 * rank)  # the per-(step, rank) seed the loop would set
    engine.train()
    result = step(rank_chunks(images, tokens, rank, world, k), record=True, optimizer_step=False)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"no gradient for {missing}"
    grads = {n: g.clone() for n, g in grads.items()}
    engine.step()
    weights = {n: full_param(p) for n, p in engine.module.named_parameters()}
    # Pass 2 visits the chunks in pass-1 order, so the recorded lists line up.
    assert len(step.last_cached) == len(step.last_reforwarded) == k
    same_embeddings = all(
        torch.equal(c[0], r[0]) and torch.equal(c[1], r[1]) for c, r in zip(step.last_cached, step.last_reforwarded)
    )
    from torch._dynamo.utils import counters

    return {
        "loss": result.loss,
        "grads": grads,
        "weights": weights,
        "same_embeddings": same_embeddings,
        "initial": initial,
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
        # ZeRO-1/2: DeepSpeed's per-parameter hooks were left out of the K backwards and are back afterwards
        "hooks_skipped": step.skip_zero_hooks,
        "hooks_restored": len(getattr(engine.optimizer, "_grad_acc_hooks", []))
        == sum(p.requires_grad for p in engine.module.parameters()),
    }


def reference_step(initial, world, k, patch_dropout=0.0, lr=1e-3):
    """Single process, whole batch, from the engine's initial weights (ZeRO-3 initialises layer by layer,
    so the same seed does not give the same numbers). Masks: each rank's chunks are drawn from that
    rank's seed in order, as the gradient cache's first pass draws them."""
    model = make_model(patch_dropout)
    model.load_state_dict(initial)
    model.train()
    images, tokens = make_batches(world, k)
    img_f, txt_f, scale = [], [], None
    for r in range(world):
        torch.manual_seed(SEED + 17 * r)
        for im, tk in rank_chunks(images, tokens, r, world, k):
            out = model(image=im, text=tk)
            img_f.append(out["image_features"])
            txt_f.append(out["text_features"])
            scale = out["logit_scale"]
    loss = reference_loss(torch.cat(img_f), torch.cat(txt_f), scale)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    from dsclip.engine.optim import param_groups

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.98), eps=EPS)
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, weights


def assert_matches(results, ref, gtol=1e-6, wtol=1e-6):
    ref_loss, ref_grads, ref_weights = ref
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
        for n, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][n], g, atol=gtol, rtol=1e-4, msg=lambda m, n=n: f"grad {n}: {m}")
        for n, w in ref_weights.items():
            torch.testing.assert_close(r["weights"][n], w, atol=wtol, rtol=1e-5, msg=lambda m, n=n: f"weight {n}: {m}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradcache_equals_big_batch(world, stage, k):
    results = run_world(_rank_step, world, stage, k, "auto", 0.0, True)
    if stage == 2:
        assert all(r["hooks_skipped"] and r["hooks_restored"] for r in results)
    assert_matches(results, reference_step(results[0]["initial"], world, k))


@pytest.mark.parametrize("stage", [0, 1, "2off", "3off"])
def test_gradcache_other_zero_stages_and_offload(stage):
    """ZeRO-0/1 reduce at the boundary (no coalescing needed); ZeRO-2/3 with CPU offload coalesce, and
    their offloaded step is DeepSpeed's CPU Adam, whose weights must equal torch AdamW's reference."""
    results = run_world(_rank_step, 2, stage, 2, "auto", 0.0, True)
    expected = "DeepSpeedCPUAdam" if str(stage).endswith("off") else "AdamW"
    assert all(r["optimizer"] == expected for r in results), [r["optimizer"] for r in results]
    assert_matches(results, reference_step(results[0]["initial"], 2, 2))


def test_gradcache_without_kept_graph_equals_big_batch():
    results = run_world(_rank_step, 2, 2, 2, "auto", 0.0, False)
    assert_matches(results, reference_step(results[0]["initial"], 2, 2))


def test_dropout_and_patch_dropout_masks_replayed_bit_for_bit():
    model = make_model(0.5).train()  # the masks really are random: two forwards differ
    images, tokens = make_batches(1, 1)
    a, b = model(image=images, text=tokens), model(image=images, text=tokens)
    assert not torch.allclose(a["image_features"], b["image_features"])
    assert not torch.allclose(a["text_features"], b["text_features"])
    results = run_world(_rank_step, 2, 2, 4, "auto", 0.5, False)
    assert all(r["same_embeddings"] for r in results)
    assert_matches(results, reference_step(results[0]["initial"], 2, 4, patch_dropout=0.5))


def test_naive_multi_backward_is_wrong_under_zero2():
    """What forks that call engine.backward K times do: ZeRO-2 keeps only part of the gradient."""
    results = run_world(_rank_step, 2, 2, 2, "naive", 0.0, True)
    with pytest.raises(AssertionError):
        assert_matches(results, reference_step(results[0]["initial"], 2, 2))


@pytest.mark.parametrize("stage", [2, 3])
def test_torchcompile_blocks_keep_gradcache_exact(stage):
    """--torchcompile (blocks through dynamo + AOTAutograd, i.e. the traced graphs inductor would lower),
    ZeRO-2/3 hooks around them, with dropout / patch dropout: masks replayed, big-batch gradients."""
    results = run_world(_rank_step, 2, stage, 2, "auto", 0.5, True, "aot_eager")
    assert all(r["compiled_graphs"] > 0 for r in results)
    assert all(r["same_embeddings"] for r in results)
    assert_matches(results, reference_step(results[0]["initial"], 2, 2, patch_dropout=0.5))


def test_torchcompile_inductor_matches_big_batch():
    """The real backend: inductor-generated C++ kernels. fallback_random keeps the masks those of eager
    code; fused kernels round differently, hence the looser tolerance."""
    results = run_world(_rank_step, 1, 2, 2, "auto", 0.5, True, "inductor")
    assert results[0]["compiled_graphs"] > 0
    assert results[0]["same_embeddings"]
    assert_matches(results, reference_step(results[0]["initial"], 1, 2, patch_dropout=0.5), gtol=2e-5, wtol=2e-5)
