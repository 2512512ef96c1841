"""Scale smoke on CPU: ViT-H-14 / ViT-bigG-14 under ZeRO-3 on 2 gloo ranks.

1. Construction under ``zero.Init`` (dsclip.engine.build.construction_context + create_model +
   init_weights(gather=...)) never materialises the model on a rank: each rank's peak RSS stays well
   below the full fp32 model (ViT-bigG-14: 2.54 B params = 10.2 GB fp32; ViT-H-14: 0.99 B = 3.9 GB).
2. One real training step of ViT-H-14 at 224 px, batch 1 per rank, --accum-freq 2, bf16, ZeRO-3,
   activation checkpointing (through build_engine) and the gradient cache.

Measured here: construction ViT-H-14 ~100 s, ViT-bigG-14 ~190-280 s (peak RSS per rank 2.0 / ~4 GB with
a fixed glibc mmap threshold); the ViT-H-14 step ~200 s with a peak RSS of ~10 GB per rank (about 1 GB
of it shared libraries), i.e. ~20 GB for the pair: at the edge of the CI budget, so it is marked slow
and skips itself (with the reason) when less than 16 GB is available. To get there the step uses
DeepSpeed's ``bf16.bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` (fp32 master + moments
would add ~3 GB per rank) and bounds ZeRO-3's transients (sub_group_size, live/reuse limits); with the
shipped values one rank peaked at 9.7 GB anonymous memory before the optimizer step and was OOM-killed.
"""

from __future__ import annotations

import os

import pytest

from dsclip.model import create_model  # noqa: F401  (import before zero.Init patches torch; see test_gradcache)
from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.slow]
GB = 1e9


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    return 0.0


def _peak_rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GB
    return float("nan")


def _run_config(model: str, **extra):
    from dsclip.config import make_run_config

    values = {
        "name": "scale",
        "model": model,
        "batch_size": 1,
        "accum_freq": 2,
        "precision": "bf16",
        "deepspeed_config": "ds_configs/zero3_bf16.json",
        "lr": 1e-4,
        "warmup": 0,
        "lr_scheduler": "const",
    }
    values.update(extra)
    return make_run_config(values)


def _build_partitioned(rank, world, model):
    import torch

    from dsclip.engine.build import construction_context
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config

    cfg = _run_config(model)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    import deepspeed

    # Without this explicit call zero.Init's DeepSpeedConfig saw world size 1 here (train_batch_size 4 !=
    # 2 * 1 * 1), although construction_context calls init_distributed itself; build_engine is unaffected.
    deepspeed.init_distributed(dist_backend="gloo")
    base = _peak_rss_gb()
    torch.manual_seed(0)
    with construction_context(ds):
        m = create_model(model)
    m.init_weights(gather=lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0))
    total = sum(p.ds_numel for p in m.parameters())
    local = sum(p.ds_tensor.numel() for p in m.parameters())
    dtypes = {str(p.ds_tensor.dtype) for p in m.parameters()}
    return {
        "total": total,
        "local": local,
        "dtypes": dtypes,
        "peak_gb": _peak_rss_gb(),
        "base_gb": base,
        "placeholder_numel": sum(p.numel() for p in m.parameters()),
    }


@pytest.mark.parametrize("model,params_b", [("ViT-H-14", 0.986), ("ViT-bigG-14", 2.54)])
def test_zero3_init_never_materialises_the_model(model, params_b):
    full_fp32_gb = params_b * 4
    need = 2 * (params_b * 2 / 2 + 1.0)  # two ranks: a bf16 half each + interpreter/torch
    if _mem_available_gb() < need + 1:
        pytest.skip(f"needs ~{need:.0f} GB available, have {_mem_available_gb():.1f}")
    # A fixed mmap threshold makes glibc return every freed large block to the OS at once; with its default
    # dynamic threshold the fp32 layers zero.Init builds and frees one by one stay in the heap as
    # fragmentation and the RSS high-water mark no longer says what was alive.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    try:
        res = run_world(_build_partitioned, 2, model, timeout=900)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    for r in res:
        assert abs(r["total"] / 1e9 - params_b) < 0.01 * params_b
        assert r["local"] * 2 >= r["total"] and r["local"] < 0.51 * r["total"]  # each rank: its half (+padding)
        assert r["dtypes"] == {"torch.bfloat16"}
        assert r["placeholder_numel"] == 0  # every parameter is an empty placeholder outside a gather
        # "well below": what construction added to the rank's peak RSS (its bf16 half, one layer at a time
        # in flight) stays under 45% of the fp32 model, and the whole process (interpreter, torch, DeepSpeed
        # included) under 55%; materialising the model even once would exceed 100%.
        assert r["peak_gb"] - r["base_gb"] < 0.45 * full_fp32_gb, (r, full_fp32_gb)
        assert r["peak_gb"] < 0.55 * full_fp32_gb, (r, full_fp32_gb)


def _train_step(rank, world, model="ViT-H-14"):
    import torch

    from dsclip.engine.build import autocast_dtype, build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.loop import step_seed

    cfg = _run_config(model, grad_checkpointing=True)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    # Bound ZeRO-3's transient memory on a RAM-limited CPU box: the optimizer steps one sub-group at a
    # time (its temporaries scale with sub_group_size, 1e9 elements by default = the whole partition
    # here), and at most 1e8 gathered elements stay live / are reused. With the shipped values one rank
    # of this step peaked at 9.7 GB and was OOM-killed.
    ds["zero_optimization"].update(
        sub_group_size=50_000_000,
        stage3_max_live_parameters=100_000_000,
        stage3_max_reuse_distance=100_000_000,
        stage3_prefetch_bucket_size=50_000_000,
    )

    def factory():
        torch.manual_seed(0)
        return create_model(model)

    bundle = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        factory,
        grad_checkpointing=cfg.model.grad_checkpointing,
        total_steps=10,
        steps_per_epoch=10,
    )
    engine = bundle.engine
    step = GradCacheStep(engine, build_loss("infonce"), keep_last_graph=True, compute_dtype=autocast_dtype(bundle))
    g = torch.Generator().manual_seed(rank)
    chunks = []
    for _ in range(2):  # K = 2 micro-batches of 1 sample at 224 px
        img = torch.randn(1, 3, 224, 224, generator=g)
        tok = torch.randint(1, 49000, (1, 77), generator=g)
        tok[0, 10] = 49407  # EOT: argmax pooling
        tok[0, 11:] = 0
        chunks.append((img, tok))
    from deepspeed.utils import safe_get_full_fp32_param

    proj = engine.module.visual.proj
    before = safe_get_full_fp32_param(proj).float().clone()
    torch.manual_seed(step_seed(0, 0, rank))
    engine.train()
    result = step(chunks)
    after = safe_get_full_fp32_param(proj).float()
    return {
        "loss": result.loss,
        "applied": result.applied,
        "moved": (after - before).abs().max().item(),
        "peak_gb": _peak_rss_gb(),
        "ckpt": engine.module.visual.grad_checkpointing,
    }


def _check_step(res):
    import math

    for r in res:
        assert r["applied"] and r["ckpt"]
        assert math.isfinite(r["loss"]) and abs(r["loss"] - math.log(4)) < 1.0  # 4 pairs, random init
        assert r["moved"] > 0
    assert res[0]["loss"] == pytest.approx(res[1]["loss"])


def test_vit_b32_training_step_zero3_checkpointing():
    """The ViT-H-14 step's exact code path on ViT-B-32 (0.15 B params, ~1 GB per rank)."""
    _check_step(run_world(_train_step, 2, "ViT-B-32", timeout=600))


def test_vit_h_training_step_zero3_checkpointing_gradient_cache():
    need = 2 * 8.0  # measured: VmHWM ~10 GB per rank, ~1 GB of it shared torch/DeepSpeed libraries
    if _mem_available_gb() < need:
        pytest.skip(f"needs ~{need:.0f} GB available for two ViT-H-14 ZeRO-3 ranks, have {_mem_available_gb():.1f}")
    _check_step(run_world(_train_step, 2, "ViT-H-14", timeout=900))
