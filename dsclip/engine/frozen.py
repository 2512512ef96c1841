"""A forward-only ZeRO-3 engine for a frozen model (the distillation teacher under ZeRO-3).

Why a second engine: under ZeRO-3 the run is memory-bound, so the teacher is partitioned like the
student (``zero.Init`` at construction, each rank keeps 1/world of every weight) instead of being held
whole on every rank; its forward gathers one layer at a time and frees it again. DeepSpeed builds no
optimizer for it (``deepspeed.initialize`` without one gives ZeRO-3's parameter-offload wrapper only),
and nothing ever saves it. The price is the teacher's weights all-gathered once per micro-batch, and its
forward is collective: every rank runs it (the gradient cache's pass 1 does, on every rank).
"""

from __future__ import annotations

from collections.abc import Callable

import deepspeed
from torch import nn

from dsclip.engine.build import init_redone_after

# What the frozen engine takes from the run's DeepSpeed config: batch triad, precision, ZeRO-3 knobs.
_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16", "fp16")


def frozen_ds_config(ds_config: dict) -> dict:
    """The run's config without anything that trains (optimizer, scheduler, clipping, optimizer offload)."""
    out = {k: ds_config[k] for k in _KEYS if k in ds_config}
    zero = {k: v for k, v in ds_config.get("zero_optimization", {}).items() if k != "offload_optimizer"}
    out["zero_optimization"] = {**zero, "stage": 3}
    return out


def build_frozen_zero3(
    ds_config: dict, model_factory: Callable[[], nn.Module], load: Callable[[nn.Module], None]
) -> deepspeed.DeepSpeedEngine:
    """``model_factory()`` partitioned as it is built, ``load(model)`` (collective: fills the weights),
    frozen, in eval mode, wrapped in a ZeRO-3 engine without optimizer. Call on every rank."""
    cfg = frozen_ds_config(ds_config)
    # The model's own random init is skipped for partitioned layers; the weights all come from ``load`` next
    with deepspeed.zero.Init(config_dict_or_path=cfg), init_redone_after():
        model = model_factory()
    load(model)
    model.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    engine.eval()
    return engine
