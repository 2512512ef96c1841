"""Checks a ``dsclip train`` run can make before the process group exists and before DeepSpeed loads.

A bad model name, tokenizer, data pattern, checkpoint path or fp16 on a CPU-only machine is a one-line
error within seconds of start-up, instead of after the world set-up and an engine build (minutes on a
first run). Everything here is per-rank, cheap and collective-free; the checks later in
:func:`dsclip.train.loop.build_run` stay as the authority (they see the pretrained weights' settings).

:func:`check` also decides one default: without ``--tokenizer``, an OpenCLIP architecture trained on
real data uses OpenCLIP's own tokenizer (``open_clip:MODEL``), as an OpenCLIP user expects.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dsclip.config import RunConfig
from dsclip.config_base import ConfigError
from dsclip.console import say

# Models that may train on the built-in demo set without --train-data: the demo model, and the tiny
# test model the test recipes use. Any other model without data is a mistake, not a wish for shapes.
DEMO_DATA_MODELS = ("demo", "tiny")

DATA_OPTIONS = (
    "--train-data 'shards/{00000..00099}.tar' (webdataset), --train-data data.csv (CSV/TSV), "
    "or --dataset-type synthetic --train-num-samples N (throughput test)"
)


def openclip_architecture(model: str) -> bool:
    """Whether ``model`` names one of OpenCLIP's architectures (its model_configs/NAME.json), found without
    importing open_clip (which loads torch and timm)."""
    from dsclip.model.factory import openclip_config_path

    return openclip_config_path(model) is not None


def check(cfg: RunConfig, *, rank: int = 0) -> RunConfig:
    """Raise ConfigError/FileNotFoundError for what is already known to fail; return ``cfg`` with the
    tokenizer default decided."""
    # cheapest first: these read files and the run config only (no torch)
    _check_model(cfg)
    _check_resume(cfg)
    kind = _check_data(cfg)
    cfg = _default_tokenizer(cfg, kind, rank=rank)
    _check_deepspeed(cfg, rank=rank)  # dsclip.engine.patches: loads torch
    # last: DeepSpeed's own schema (ds_schema) imports deepspeed's pydantic config models, the one check
    # here that loads DeepSpeed; still before the process group, the rank line and any model
    _check_ds_config(cfg)
    return cfg


def _check_model(cfg: RunConfig) -> None:
    m = cfg.model
    if m.pretrained:
        p = Path(m.pretrained)
        local = not m.pretrained.startswith(("open_clip:", "hf-hub:")) and ("/" in m.pretrained or p.suffix)
        if local and not p.exists():
            raise FileNotFoundError(2, "--pretrained weights not found", m.pretrained)
        return  # the weights may name the architecture (finetune.prepare resolves it)
    from dsclip.model import get_model_config, resolve_model_config  # UnknownModelError names the known models
    from dsclip.model.config import unsupported_parts

    model_cfg = get_model_config(m.model)
    # a JSON file of the user's: what the towers lack, or an inconsistent number, as one line naming the file
    parts = unsupported_parts(model_cfg)
    if parts:
        raise ConfigError(f"--model {m.model}: dsclip's towers do not build {'; '.join(parts)}")
    try:
        resolve_model_config(model_cfg)
    except ValueError as e:
        raise ConfigError(f"--model {m.model}: {e}") from None


def _check_ds_config(cfg: RunConfig) -> None:
    import torch

    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.engine.world.devices import remap_launcher_devices

    # CUDA reads CUDA_VISIBLE_DEVICES once, at the first query below (and DeepSpeed's accelerator detection):
    # the per-node launcher's GPU ids are translated first, as init_distributed does (it is idempotent).
    remap_launcher_devices()

    # The accelerator DeepSpeed will pick is CUDA exactly when torch sees a GPU (this project runs on
    # CUDA or CPU). The engine's own rules, applied to the JSON before the world exists: structure, the
    # installed DeepSpeed's schema, --device, precision against the accelerator, the optimizer block.
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.deepspeed_config == "auto":  # chosen among the shipped JSONs at start-up (dsclip.train.auto_ds)
        return
    resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=None, device_type=device_type
    )


def _check_deepspeed(cfg: RunConfig, *, rank: int) -> None:
    """From the installed DeepSpeed's version alone (no import): --engine-patches names, --accum-freq > 1
    without exact accumulation (issue #34), and one line when the version is outside the tested range."""
    from dsclip.engine.accumulation import refusal
    from dsclip.engine.patches import PatchSelectionError, parse_selection
    from dsclip.engine.versions import has_coalesced_reduction, outside_tested_range

    try:
        parse_selection(cfg.train.engine_patches)
    except PatchSelectionError as e:
        raise ConfigError(str(e)) from e
    if cfg.train.accum_freq > 1 and not has_coalesced_reduction():
        raise refusal(cfg.train.accum_freq)
    line = outside_tested_range()
    if line is not None and rank == 0:
        say(line)


def _check_resume(cfg: RunConfig) -> None:
    resume = cfg.checkpoint.resume
    if not resume or resume == "latest":
        return
    p = Path(resume)
    if p.is_file() and p.name != "latest":  # RUN/checkpoints/latest, DeepSpeed's pointer file, names the run's tag
        raise ConfigError(
            f"--resume {resume}: a single-file checkpoint (e.g. OpenCLIP's epoch_N.pt) cannot be resumed; "
            f"to start from its weights use --pretrained {resume} (--resume takes a dsclip run or checkpoint folder)"
        )
    from dsclip.checkpoint.ds_checkpoint import resolve_resume

    # FileNotFoundError naming what is missing; the files are checked against the manifest later, on rank 0
    resolve_resume(resume, Path("."), verify=False)


def _check_data(cfg: RunConfig) -> str:
    d = cfg.data
    try:
        kind = d.resolved_dataset_type()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    implicit_demo = kind == "demo" and d.dataset_type == "auto" and not cfg.model.pretrained  # fine-tuning: the
    if implicit_demo and cfg.model.model not in DEMO_DATA_MODELS:  # weights' own model on demo data is a test
        raise ConfigError(
            f"--model {cfg.model.model} needs training data: pass {DATA_OPTIONS} "
            f"(the built-in demo set trains only --model demo; --dataset-type demo to insist)"
        )
    if kind == "webdataset":
        from dsclip.data.shards import parse_sources

        try:
            parse_sources(d.train_data, d.train_data_upsampling_factors)
        except ValueError as e:
            raise ConfigError(f"--train-data: {e}") from None
    elif kind == "csv":
        path = d.train_data.split("::")[0]
        if not os.path.isfile(path):
            raise FileNotFoundError(2, "--train-data CSV not found", path)
    return kind


def _default_tokenizer(cfg: RunConfig, kind: str, *, rank: int) -> RunConfig:
    d = cfg.data
    if d.tokenizer:
        if not d.tokenizer.startswith("open_clip:") and not os.path.isfile(d.tokenizer):
            raise FileNotFoundError(2, "--tokenizer sentencepiece model not found", d.tokenizer)
        return cfg
    if kind in ("demo", "synthetic") or cfg.model.pretrained:  # demo tokenizer / the weights' own tokenizer
        return cfg
    if openclip_architecture(cfg.model.model):
        tok = f"open_clip:{cfg.model.model}"
        if rank == 0:
            say(f"dsclip: no --tokenizer: using OpenCLIP's tokenizer for {cfg.model.model} ({tok})")
        return dataclasses.replace(cfg, data=dataclasses.replace(d, tokenizer=tok))
    raise ConfigError(
        f"--model {cfg.model.model} has no default tokenizer: pass --tokenizer path/to/spm.model (a sentencepiece "
        "model; train one with `dsclip tokenizer train`) or --tokenizer open_clip:MODEL (OpenCLIP's tokenizer)"
    )
