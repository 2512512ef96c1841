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

from dataclasses import dataclass

from torch import nn

from .common import BatchLayout, LossInputError, check_inputs
from .distributed import all_gather_with_grad, all_reduce_mean, all_reduce_sum_with_grad, get_rank_world
from .infonce import InfoNCELoss
from .siglip import SIGLIP_INIT_LOGIT_BIAS, SIGLIP_INIT_LOGIT_SCALE, SigLipRingLoss
from .tiled import TiledInfoNCELoss

LOSS_NAMES = ("infonce", "infonce_local", "infonce_tiled", "siglip")

__all__ = [
    "LOSS_NAMES",
    "LossConfig",
    "build_loss",
    "InfoNCELoss",
    "TiledInfoNCELoss",
    "SigLipRingLoss",
    "LossInputError",
    "BatchLayout",
    "check_inputs",
    "all_gather_with_grad",
    "all_reduce_sum_with_grad",
    "all_reduce_mean",
    "get_rank_world",
    "SIGLIP_INIT_LOGIT_SCALE",
    "SIGLIP_INIT_LOGIT_BIAS",
]


@dataclass
class LossConfig:
    """Loss selection (run config section ``loss``)."""

    name: str = "infonce_local"
    """One of: infonce (global N x N on every rank), infonce_local (OpenCLIP --local-loss
    --gather-with-grad, b x N per rank), infonce_tiled (memory-bounded ring InfoNCE, same value as
    infonce), siglip (sigmoid loss with logit_bias, tiled ring)."""
    tile_size: int = 1024
    """Rows/columns per tile for infonce_tiled and siglip (need not divide the batch)."""
    label_smoothing: float = 0.0
    """InfoNCE label smoothing (as torch cross_entropy's label_smoothing); not for siglip."""
    check_finite: bool = True
    """Raise LossInputError on every rank if any rank's features/scale/bias hold NaN or Inf."""

    def __post_init__(self):
        if self.name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.name!r}; choose one of {', '.join(LOSS_NAMES)}")
        if int(self.tile_size) < 1:
            raise ValueError(f"tile_size must be >= 1, got {self.tile_size}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.name == "siglip" and self.label_smoothing:
            raise ValueError("label_smoothing applies to the InfoNCE losses, not siglip")


def build_loss(
    name: str | LossConfig = "infonce_local",
    *,
    tile_size: int = 1024,
    label_smoothing: float = 0.0,
    check_finite: bool = True,
    group=None,
) -> nn.Module:
    """Build a loss module by name (see :data:`LOSS_NAMES`) or from a :class:`LossConfig`.

    When a ``LossConfig`` is given, the keyword arguments other than ``group`` are ignored.
    """
    cfg = (
        name
        if isinstance(name, LossConfig)
        else LossConfig(name=name, tile_size=tile_size, label_smoothing=label_smoothing, check_finite=check_finite)
    )
    if cfg.name == "infonce":
        return InfoNCELoss(local=False, label_smoothing=cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "infonce_local":
        return InfoNCELoss(local=True, label_smoothing=cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    if cfg.name == "infonce_tiled":
        return TiledInfoNCELoss(cfg.tile_size, cfg.label_smoothing, check_finite=cfg.check_finite, group=group)
    return SigLipRingLoss(cfg.tile_size, check_finite=cfg.check_finite, group=group)
