"""Contrastive losses for dsclip: InfoNCE (global / local), tiled ring InfoNCE, ring SigLIP.

Every loss is called as ``loss(image_features (b, D), text_features (b, D), logit_scale, logit_bias=None)``
with THIS rank's rows only (local batch sizes may differ between ranks) and returns a 0-dim loss.
Convention (what DeepSpeed's mean-over-ranks gradient averaging needs): the mean over ranks of the
returned losses is the full-batch loss L; the gradient w.r.t. this rank's features is
``world * dL/dx_local``; the gradient w.r.t. ``logit_scale`` / ``logit_bias`` averaged over ranks is
``dL/dscale``. Use :func:`all_reduce_mean` to log L. Every loss first exchanges a tiny metadata tensor,
so malformed input on any rank (NaN/Inf, wrong D, dtype mismatch) raises :class:`LossInputError` on
every rank instead of hanging the others.

Plain torch + torch.distributed; this package never imports deepspeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsclip.lazy_exports import lazy_exports

from .config import LOSS_NAMES, TRAIN_TILE_SIZE, LossArgs, LossConfig

if TYPE_CHECKING:
    from torch import nn

# The losses load torch, so they are imported on first use (PEP 562): the run config's parser reaches this
# package for LossArgs, and `dsclip train --help` must not load torch (issue #33). name -> submodule.
_LAZY = {
    "BatchLayout": "common",
    "LossInputError": "common",
    "check_inputs": "common",
    "DistillInfoNCELoss": "distill",
    "all_gather_with_grad": "distributed",
    "all_reduce_mean": "distributed",
    "all_reduce_sum_with_grad": "distributed",
    "InfoNCELoss": "infonce",
    "SIGLIP_INIT_LOGIT_BIAS": "siglip",
    "SIGLIP_INIT_LOGIT_SCALE": "siglip",
    "SigLipRingLoss": "siglip",
    "TiledInfoNCELoss": "tiled",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "LOSS_NAMES",
    "LossConfig",
    "LossArgs",
    "build_loss",
    "InfoNCELoss",
    "DistillInfoNCELoss",
    "TiledInfoNCELoss",
    "SigLipRingLoss",
    "LossInputError",
    "BatchLayout",
    "check_inputs",
    "all_gather_with_grad",
    "all_reduce_sum_with_grad",
    "all_reduce_mean",
    "SIGLIP_INIT_LOGIT_SCALE",
    "SIGLIP_INIT_LOGIT_BIAS",
]


def build_loss(
    name: str | LossConfig,
    *,
    tile_size: int = TRAIN_TILE_SIZE,
    label_smoothing: float = 0.0,
    check_finite: bool = True,
    group=None,
) -> nn.Module:
    """Build a loss module by name (see :data:`LOSS_NAMES`) or from a :class:`LossConfig`.

    When a ``LossConfig`` is given, the keyword arguments other than ``group`` are ignored. The keyword
    defaults are LossConfig's (the one definition); ``dsclip train`` builds from ``LossArgs.loss_config()``.
    """
    from .distill import DistillInfoNCELoss
    from .infonce import InfoNCELoss
    from .siglip import SigLipRingLoss
    from .tiled import TiledInfoNCELoss

    cfg = (
        name
        if isinstance(name, LossConfig)
        else LossConfig(name=name, tile_size=tile_size, label_smoothing=label_smoothing, check_finite=check_finite)
    )
    if cfg.distill:  # LossConfig allows it with infonce / infonce_local only
        local = cfg.name == "infonce_local"
        return DistillInfoNCELoss(local, cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "infonce":
        return InfoNCELoss(local=False, label_smoothing=cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "infonce_local":
        return InfoNCELoss(local=True, label_smoothing=cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "infonce_tiled":
        return TiledInfoNCELoss(cfg.tile_size, cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "siglip":
        return SigLipRingLoss(cfg.tile_size, check_finite=cfg.check_finite, group=group)
    # LossConfig validates the name; this line is for a LossConfig built around that check (a new name
    # added to LOSS_NAMES without a branch here must not silently become another loss)
    raise ValueError(f"unknown loss {cfg.name!r}: choose one of {', '.join(LOSS_NAMES)}")
