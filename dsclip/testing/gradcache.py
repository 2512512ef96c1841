"""The gradient-cache setup the tests share: the tiny model, its seeded global batch, each rank's
micro-batches and the run config (fp32, constant LR, a shipped or derived ZeRO JSON).

The big-batch equality suite (tests/dist/test_gradcache.py) checks dsclip against a single-process
reference built from these (bench/results/host-syncs_cpu2_2026-11-30.md counted the same step's host
syncs). The ZeRO JSON paths are relative to the repository root, where the tests run.
"""

from __future__ import annotations

import torch

from dsclip.model import create_model, get_model_config

B, SEED = 4, 1234
# Adam's first step moves each weight by lr·g/(|g|+eps), sensitivity up to lr/eps to its gradient
# (tests/tolerances.adam_first_step_sensitivity). eps 1e-4 (not 1e-6: sensitivity 1000) keeps the weight
# check within a factor 10 of the gradient check, so it still sees errors in the update itself.
EPS = 1e-4
LR = 1e-3


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
    from dsclip.engine.ds_config import load_ds_json

    raw = load_ds_json("zero3_fp32" if stage == "3off" else "zero2_fp32")
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


def make_cfg(stage, k, lr=LR, compile_backend=None):
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
