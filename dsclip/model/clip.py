"""CLIP: image tower + text tower + learnable temperature (and SigLIP bias), plain PyTorch.

DeepSpeed-facing choices (see docs/deepspeed-notes.md):
- ``logit_scale`` / ``logit_bias`` parameters are 1-D, shape (1,): a 0-dim parameter crashes
  ``deepspeed.initialize``. ``forward`` returns them as 0-dim tensors.
- The clamp to ln(100) happens inside ``forward`` (an in-place clamp after ``step()`` would be overwritten
  by the bf16/fp16 optimizer's fp32 master copy), and the returned scale is ``exp(clamped)``.
- ``forward`` returns ``logit_scale`` / ``logit_bias`` so their gradients flow through the engine's
  forward (under ZeRO-3 a parameter read outside forward is an empty placeholder).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import CheckpointFn, GatherFn, InitPlan, apply_init_plan
from .config import init_logit_scale, resolve_model_config
from .text import TextTower
from .timm_vit import is_timm_tower, timm_vit_spec
from .vision import VisionTower

LOGIT_SCALE_MAX = math.log(100.0)
logger = logging.getLogger(__name__)


class CLIP(nn.Module):
    """Two-tower CLIP built from an OpenCLIP-schema config (see ``dsclip.model.config``).

    Parameter names: ``visual.*`` (timm ViT names + ``visual.proj``), ``text.*``, ``logit_scale`` and,
    for SigLIP configs (``init_logit_bias``), ``logit_bias``. ``dsclip.model.openclip`` maps them to and
    from OpenCLIP's native layout.
    """

    def __init__(self, config: dict, *, force_patch_dropout: bool = False):
        super().__init__()
        self.config = resolve_model_config(config)
        cfg = self.config
        self.visual = _vision_tower(cfg, force_patch_dropout)
        self.text = _text_tower(cfg)
        self.logit_scale = nn.Parameter(torch.full((1,), init_logit_scale(cfg)))
        if cfg.get("init_logit_bias") is not None:
            self.logit_bias = nn.Parameter(torch.full((1,), float(cfg["init_logit_bias"])))
        else:
            self.register_parameter("logit_bias", None)
        skipped = self.visual.init_skipped + self.text.init_skipped
        if skipped:
            logger.warning(
                "%d layers were partitioned (ZeRO-3 zero.Init) before the OpenCLIP init could run and keep "
                "torch's default init; call model.init_weights(gather=...) after construction",
                skipped,
            )

    def init_plan(self) -> InitPlan:
        def own():
            self.logit_scale.fill_(init_logit_scale(self.config))
            if self.logit_bias is not None:
                self.logit_bias.fill_(float(self.config["init_logit_bias"]))

        return [*self.visual.init_plan(), *self.text.init_plan(), (self, own)]

    def init_weights(self, gather: GatherFn | None = None) -> None:
        """(Re-)run OpenCLIP's initialisation, one layer at a time.

        Construction already does this, except under DeepSpeed ZeRO-3 ``zero.Init``, which partitions
        each child layer as soon as it is built: those layers are skipped (a warning says how many).
        Call ``model.init_weights(gather=lambda ps: deepspeed.zero.GatheredParameters(ps,
        modifier_rank=0))`` on every rank after construction to initialise them properly; each layer
        is gathered on its own, so memory stays bounded by the largest layer."""
        skipped = apply_init_plan(self.init_plan(), gather)
        if skipped:
            raise RuntimeError(f"{skipped} layers are partitioned; pass gather= to materialise them")

    # -- convenience -------------------------------------------------------------------------------
    @property
    def embed_dim(self) -> int:
        return self.config["embed_dim"]

    @property
    def image_size(self) -> int:
        return self.config["vision_cfg"]["image_size"]

    @property
    def context_length(self) -> int:
        return self.config["text_cfg"]["context_length"]

    # -- API ---------------------------------------------------------------------------------------
    def encode_image(self, image: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.visual(image)  # (B, D)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.text(text)  # (B, D)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None) -> dict:
        return {
            "image_features": self.encode_image(image) if image is not None else None,  # (B, D)
            "text_features": self.encode_text(text) if text is not None else None,  # (B, D)
            "logit_scale": self.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp().squeeze(0),  # 0-dim
            "logit_bias": self.logit_bias.squeeze(0) if self.logit_bias is not None else None,  # 0-dim
        }

    def set_grad_checkpointing(self, enable: bool = True, checkpoint_fn: CheckpointFn | None = None) -> None:
        """Run every transformer block through ``checkpoint_fn(function, *args)``; default
        ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""
        self.visual.set_grad_checkpointing(enable, checkpoint_fn)
        self.text.set_grad_checkpointing(enable, checkpoint_fn)

    def compile_blocks(self, **compile_kwargs) -> int:
        """``torch.compile`` every transformer block in place (``nn.Module.compile``); returns how many.

        Per block, as torchtitan does, not the whole model: the blocks of a tower share one code
        object, so one compiled graph serves every layer (compile time does not grow with depth), and
        everything around the blocks that is awkward to trace (activation checkpointing's autograd
        function, ZeRO-3's parameter hooks, the loss's collectives) stays eager. In-place compilation
        keeps parameter names, so checkpoints and OpenCLIP export are unchanged."""
        n = 0
        for tower in (self.visual, self.text):
            for blk in tower.blocks:
                blk.compile(**compile_kwargs)
                n += 1
        return n

    def set_patch_dropout(self, prob: float | None = None, force: bool | None = None) -> None:
        """Change the patch-dropout rate and/or whether it also applies in eval mode."""
        self.visual.set_patch_dropout(prob, force)
        if prob is not None:
            self.config["vision_cfg"]["patch_dropout"] = float(prob)

    def no_weight_decay(self) -> set[str]:
        names = {f"visual.{n}" for n in self.visual.no_weight_decay()}
        names |= {f"text.{n}" for n in self.text.no_weight_decay()}
        names |= {"logit_scale", "logit_bias"}
        params = {n for n, _ in self.named_parameters()}
        return names & params


def _vision_tower(cfg: dict, force_patch_dropout: bool) -> VisionTower:
    """The image tower of a resolved model config: OpenCLIP's ViT, or one of timm's (``timm_model_name``)."""
    vcfg = cfg["vision_cfg"]
    timm_layout = (
        timm_vit_spec(vcfg["timm_model_name"], vcfg["timm_pool"], vcfg["timm_proj"]) if is_timm_tower(vcfg) else None
    )
    return VisionTower(
        embed_dim=cfg["embed_dim"],
        image_size=vcfg["image_size"],
        patch_size=vcfg["patch_size"],
        width=vcfg["width"],
        layers=vcfg["layers"],
        head_width=vcfg["head_width"],
        mlp_ratio=vcfg["mlp_ratio"],
        patch_dropout=vcfg["patch_dropout"],
        ls_init_value=vcfg["ls_init_value"],
        norm_kwargs=vcfg.get("norm_kwargs"),
        quick_gelu=cfg["quick_gelu"],
        force_patch_dropout=force_patch_dropout,
        dropout=vcfg["dropout"],
        attn_dropout=vcfg["attn_dropout"],
        drop_path_rate=vcfg["drop_path_rate"],
        timm_layout=timm_layout,
        project=timm_layout is None or vcfg["timm_proj"] != "none",
    )


def _text_tower(cfg: dict) -> TextTower:
    """The text tower of a resolved model config."""
    tcfg = cfg["text_cfg"]
    return TextTower(
        embed_dim=cfg["embed_dim"],
        context_length=tcfg["context_length"],
        vocab_size=tcfg["vocab_size"],
        width=tcfg["width"],
        heads=tcfg["heads"],
        layers=tcfg["layers"],
        mlp_ratio=tcfg["mlp_ratio"],
        ls_init_value=tcfg["ls_init_value"],
        pool_type=tcfg["pool_type"],
        eos_id=tcfg["eos_id"],
        pad_id=tcfg["pad_id"],
        norm_kwargs=tcfg.get("norm_kwargs"),
        dropout=tcfg["dropout"],
        attn_dropout=tcfg["attn_dropout"],
        drop_path_rate=tcfg["drop_path_rate"],
        quick_gelu=cfg["quick_gelu"],
        causal=not tcfg["no_causal_mask"],
        proj_bias=tcfg["proj_bias"],
        act_kwargs=tcfg["act_kwargs"],
    )
