"""SigLIP sigmoid loss over the global batch, ring-exchanged with bounded memory per step.

OpenCLIP ``SigLipLoss`` semantics: ``loss = -sum_ij log sigmoid(label_ij * (scale * x_i . y_j + bias)) / b``
with ``label = +1`` on matching pairs and ``-1`` elsewhere, rank r's image rows against every text.
OpenCLIP's ring keeps every exchanged block's activations for autograd (memory grows with the
number of ranks, open_clip issue #942); here the blocks are processed in tiles by the custom
autograd Function of :mod:`.tiled`, which keeps only the embeddings and recomputes tiles in backward.

For uneven local batches the per-rank normaliser is ``world / N`` instead of ``1 / b`` (identical when
the batches are equal) so that the mean over ranks of the returned loss is the full-batch loss
``-sum_ij log sigmoid(...) / N``. Gradients follow the team convention (see CONTRACTS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import ContrastiveLoss
from .distributed import Ring
from .tiled import _check_tile, _RingTiledFn, _SigLipKernel

# OpenCLIP --siglip initialisation: logit_scale = exp(log 10), logit_bias = -10
SIGLIP_INIT_LOGIT_SCALE = 10.0
SIGLIP_INIT_LOGIT_BIAS = -10.0


class SigLipRingLoss(ContrastiveLoss):
    """Sigmoid contrastive loss (``logit_bias`` learnable; ``None`` means no bias), tiled ring."""

    def __init__(self, tile_size: int = 1024, *, check_finite: bool = True, group=None):
        super().__init__(check_finite=check_finite, group=group)
        self.tile_size = _check_tile(tile_size)

    def extra_repr(self) -> str:
        return f"tile_size={self.tile_size}"

    def compute(self, image_features, text_features, logit_scale, logit_bias, lay) -> Tensor:
        s = torch.as_tensor(logit_scale).reshape(())
        b = None if logit_bias is None else torch.as_tensor(logit_bias).reshape(())
        value = _RingTiledFn.apply(
            image_features, text_features, s, b, _SigLipKernel, lay, Ring(self.group), self.tile_size
        )
        return value * (lay.world / lay.total)
