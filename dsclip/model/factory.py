"""Architecture registry (``configs/*.json``, OpenCLIP schema) and ``create_model``."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsclip.config_base import ConfigError, opt

from .config import TEXT_DEFAULTS, resolve_model_config, unsupported_parts

if TYPE_CHECKING:
    import torch

    from .clip import CLIP

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class ModelArgs:
    """Run config section ``model``: which architecture, its overrides and initial weights."""

    model: str = opt(
        "demo",
        "Architecture name (dsclip/model/configs/*.json, OpenCLIP schema; with open_clip_torch installed also "
        "any ViT in OpenCLIP's registry) or a JSON path.",
    )
    pretrained: str | None = opt(
        None,
        "Initial weights: a dsclip or OpenCLIP checkpoint (.safetensors/.pt/.bin or a folder), an OpenCLIP "
        "pretrained tag of --model (laion2b_s34b_b79k), open_clip:MODEL/TAG, or hf-hub:ORG/NAME.",
    )
    cache_dir: str | None = opt(None, "Where --pretrained downloads are cached (OpenCLIP's --cache-dir).")
    force_patch_dropout: float | None = opt(
        None, "Override the architecture's patch-dropout rate (FLIP), as OpenCLIP's flag: training only."
    )
    grad_checkpointing: bool = opt(
        False,
        "Activation checkpointing of every transformer block (DeepSpeed's implementation, configured by "
        "the activation_checkpointing block of the DeepSpeed JSON).",
    )
    context_length: int | None = opt(
        None, "Override the text context length of the architecture.", aliases=("--force-context-length",)
    )
    force_quick_gelu: bool = opt(False, "Use QuickGELU activations whatever the architecture JSON says (OpenCLIP's).")

    def check(self) -> None:
        if self.force_patch_dropout is not None and not 0.0 <= self.force_patch_dropout < 1.0:
            raise ConfigError(f"'force_patch_dropout' must be in [0, 1), got {self.force_patch_dropout}")


class UnknownModelError(ValueError):
    """An architecture name that is neither a registered config nor a JSON file."""


class UnsupportedModelError(UnknownModelError):
    """An OpenCLIP architecture whose towers dsclip does not build (timm/HF towers, ResNet, CoCa, ...)."""


def list_models() -> list[str]:
    """Names of the registered architectures (``dsclip/model/configs/*.json``), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def openclip_config_path(name: str) -> Path | None:
    """OpenCLIP's ``model_configs/NAME.json`` when open_clip is installed, found without importing it (which
    loads torch, timm and its tokenizers)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations or "/" in name or os.sep in name:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "model_configs" / f"{name}.json"
        if path.is_file():
            return path
    return None


def _openclip_config(name: str, path: Path) -> dict:
    """An OpenCLIP architecture as dsclip builds it, or one line naming what dsclip's towers lack."""
    with open(path) as f:
        cfg = json.load(f)
    parts = unsupported_parts(cfg)
    if parts:
        raise UnsupportedModelError(
            f"--model {name}: OpenCLIP's architecture has what dsclip's towers do not build: {'; '.join(parts)}; "
            "dsclip trains OpenCLIP's ViT + text-transformer architectures and timm ViT towers, e.g. ViT-B-32, "
            "ViT-L-14-336, ViT-B-16-SigLIP"
        )
    return cfg


def get_model_config(name_or_path: str | os.PathLike) -> dict:
    """The OpenCLIP-schema dict for a registered name or a JSON file (a bare model config or a
    ``{"model_cfg": ...}`` wrapper such as ``open_clip_config.json``). Returns a fresh copy (unresolved)."""
    path = Path(name_or_path)
    if str(name_or_path).endswith(".json") or path.is_file():
        if not path.is_file():
            raise UnknownModelError(f"model config file not found: {path}")
        with open(path) as f:
            cfg = json.load(f)
        return copy.deepcopy(cfg.get("model_cfg", cfg))
    registered = CONFIG_DIR / f"{name_or_path}.json"
    if not registered.is_file():
        # OpenCLIP's registry, where installed: its name for every architecture beyond dsclip's own JSONs
        openclip = openclip_config_path(str(name_or_path))
        if openclip is not None:
            return _openclip_config(str(name_or_path), openclip)
        raise UnknownModelError(
            f"unknown model {str(name_or_path)!r}; available: {', '.join(list_models())}, OpenCLIP's ViT "
            "architectures when open_clip_torch is installed, or a path to a .json config"
        )
    with open(registered) as f:
        return json.load(f)


def create_model(
    name_or_cfg: str | os.PathLike | dict,
    *,
    patch_dropout: float | None = None,
    force_patch_dropout: float | bool | None = None,
    vocab_size: int | None = None,
    context_length: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    init_logit_bias: float | None = None,
    device: str | torch.device | None = None,
) -> CLIP:
    """Build a randomly initialised CLIP (OpenCLIP init) in train mode.

    - ``name_or_cfg``: a name from ``list_models()``, a path to a JSON config, or a config dict.
    - ``patch_dropout``: overrides ``vision_cfg.patch_dropout`` (the fraction of patches dropped in train).
    - ``force_patch_dropout``: ``True`` also drops patches in eval mode (normally train only). A float
      is OpenCLIP's ``create_model(force_patch_dropout=rate)`` / ``--force-patch-dropout``: it overrides
      the rate like ``patch_dropout`` and, as in OpenCLIP, still applies in train mode only.
    - ``vocab_size`` / ``context_length`` / ``eos_id`` / ``pad_id``: tokenizer-dependent ``text_cfg``
      overrides. Giving ``eos_id`` while the config pools by ``argmax`` (OpenCLIP's default, which
      only works for OpenAI's BPE whose EOT has the largest id) switches pooling to ``eos``.
    - ``init_logit_bias``: SigLIP; adds a ``logit_bias`` parameter and initialises the logit scale
      to ln(10) (unless the config sets ``init_logit_scale``).
    - ``device``: where to build the parameters; ``"meta"`` allocates nothing (parameter counting).

    The resolved config (all defaults explicit, overrides applied) is ``model.config``.
    """
    cfg = copy.deepcopy(name_or_cfg) if isinstance(name_or_cfg, dict) else get_model_config(name_or_cfg)
    cfg = cfg.get("model_cfg", cfg)
    vision, text = cfg.setdefault("vision_cfg", {}), cfg.setdefault("text_cfg", {})
    if patch_dropout is not None:
        vision["patch_dropout"] = float(patch_dropout)
    force_in_eval = False
    if isinstance(force_patch_dropout, bool):
        force_in_eval = force_patch_dropout
    elif force_patch_dropout is not None:  # a rate: OpenCLIP's create_model(force_patch_dropout=float)
        vision["patch_dropout"] = float(force_patch_dropout)
    for key, value in (("vocab_size", vocab_size), ("context_length", context_length), ("pad_id", pad_id)):
        if value is not None:
            text[key] = int(value)
    if eos_id is not None:
        text["eos_id"] = int(eos_id)
        if text.get("pool_type", TEXT_DEFAULTS["pool_type"]) == "argmax":
            logger.info("eos_id given: text pooling switched from 'argmax' to 'eos'")
            text["pool_type"] = "eos"
    if init_logit_bias is not None:
        cfg["init_logit_bias"] = float(init_logit_bias)
    cfg = resolve_model_config(cfg)

    import torch  # here: ModelArgs and the registry are read by the run config's parser, without torch (#33)

    from .clip import CLIP

    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = CLIP(cfg, force_patch_dropout=force_in_eval)
    return model
