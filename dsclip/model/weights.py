"""Consolidated single-file model weights: the format ``load_model`` reads and ``save_model`` writes.

Layout (one model per directory)::

    <dir>/model.safetensors   dsclip state dict (names as ``CLIP.state_dict()``; logit_scale shape (1,)),
                              any float dtype; safetensors metadata {"format": "dsclip"}
    <dir>/config.json         {"model_cfg": <OpenCLIP-schema model config>, ...other keys ignored}

``load_model(path)`` takes the directory or the ``.safetensors`` file inside it (any file name; the config
is the ``config.json`` beside it). For convenience it also reads OpenCLIP-layout weights: when the tensors
use OpenCLIP names (``visual.conv1.weight``, ...) they are converted with ``dsclip.model.openclip``; the
config may then also be OpenCLIP's ``open_clip_config.json`` (its ``model_cfg`` is the same schema), and
``.pt``/``.pth``/``.bin`` files are accepted. Keys and shapes are always checked in full.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .clip import CLIP
from .factory import create_model
from .openclip import (
    check_state_dict,
    from_openclip_state_dict,
    is_openclip_state_dict,
    load_openclip_checkpoint,
)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_WEIGHT_CANDIDATES = (WEIGHTS_NAME, "open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_CONFIG_CANDIDATES = (CONFIG_NAME, "open_clip_config.json")


def save_model(
    model_or_state_dict: CLIP | Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    model_config: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``<out_dir>/model.safetensors`` + ``<out_dir>/config.json``; returns the weights path.

    ``model_config`` is required when passing a bare state dict (e.g. one consolidated from ZeRO shards)
    and defaults to ``model.config`` for a model. ``dtype`` optionally casts floating tensors."""

    if isinstance(model_or_state_dict, CLIP):
        model_config = model_config or model_or_state_dict.config
        sd = model_or_state_dict.state_dict()
    else:
        sd = dict(model_or_state_dict)
    if model_config is None:
        raise ValueError("save_model needs model_config when given a state dict")
    model = create_model(model_config, device="meta")
    check_state_dict(sd, {k: v.shape for k, v in model.state_dict().items()}, "state dict to save")
    tensors = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / WEIGHTS_NAME
    save_file(tensors, str(weights), metadata={"format": "dsclip"})
    with open(out / CONFIG_NAME, "w") as f:
        json.dump({"model_cfg": model.config}, f, indent=2)
    return weights


def _resolve_paths(path: Path) -> tuple[Path, Path]:
    if path.is_dir():
        weights = next((path / n for n in _WEIGHT_CANDIDATES if (path / n).is_file()), None)
        if weights is None:
            raise FileNotFoundError(f"no weights file ({', '.join(_WEIGHT_CANDIDATES)}) in {path}")
    elif path.is_file():
        weights = path
    else:
        raise FileNotFoundError(f"model path not found: {path}")
    config = next((weights.parent / n for n in _CONFIG_CANDIDATES if (weights.parent / n).is_file()), None)
    if config is None:
        raise FileNotFoundError(f"no {' or '.join(_CONFIG_CANDIDATES)} next to {weights}")
    return weights, config


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> CLIP:
    """Load a consolidated checkpoint (see the module docstring) and return an eval-mode ``CLIP``
    whose parameters keep the stored dtype."""
    weights, config_path = _resolve_paths(Path(path))
    with open(config_path) as f:
        cfg = json.load(f)
    if "model_cfg" not in cfg:
        raise ValueError(f"{config_path} lacks 'model_cfg'")
    model_cfg = cfg["model_cfg"]
    sd = load_openclip_checkpoint(weights)  # any layout; wrappers / module. prefixes removed
    if is_openclip_state_dict(sd):
        sd = from_openclip_state_dict(sd, model_cfg)
    model = create_model(model_cfg, device="meta")
    check_state_dict(sd, {k: v.shape for k, v in model.state_dict().items()}, f"weights {weights}")
    dtypes = {v.dtype for v in sd.values() if v.is_floating_point()}
    model = model.to_empty(device=device)
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    model.load_state_dict(sd, strict=True)
    return model.eval()
