"""InfoNCE (CLIP) loss in the two OpenCLIP modes, exact across ranks.

- ``local=False`` ("infonce", global): every rank gathers all features WITH grad and computes the full
  N x N loss; equal to OpenCLIP ``ClipLoss(local_loss=False, gather_with_grad=True)``.
- ``local=True`` ("infonce_local"): each rank's rows against all columns, b x N logits; equal to
  OpenCLIP ``ClipLoss(local_loss=True, gather_with_grad=True)`` whenever the local batches are equal.

Per-rank return value (the team convention, what DeepSpeed's mean-over-ranks gradient reduction
needs): mean over ranks of the returned loss == full-batch loss L, grad(local features) ==
world * dL/dx_local, grad(logit_scale) averaged over ranks == dL/dscale. For uneven batches the local
mode weights each rank's row sum by world / N instead of OpenCLIP's 1 / b (which would not average to L).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import ContrastiveLoss, acc_dtype, check_label_smoothing
from .distributed import all_gather_columns_with_grad


class InfoNCELoss(ContrastiveLoss):
    """CLIP InfoNCE, global (``local=False``) or local-loss + gather-with-grad (``local=True``).

    ``label_smoothing`` is applied to both directions as ``torch.nn.functional.cross_entropy`` does
    (uniform mass over the N global classes). Half-precision features are upcast to fp32 for the
    logits. ``logit_bias`` is accepted (OpenCLIP adds it to the logits); it cancels in the softmax.
    """

    def __init__(self, local: bool = True, label_smoothing: float = 0.0, *, check_finite: bool = True, group=None):
        super().__init__(check_finite=check_finite, group=group)
        self.local = local
        self.label_smoothing = check_label_smoothing(label_smoothing)

    def extra_repr(self) -> str:
        return f"local={self.local}, label_smoothing={self.label_smoothing}"

    def compute(self, image_features, text_features, logit_scale, logit_bias, lay) -> Tensor:
        dt = acc_dtype(image_features.dtype)
        x, y = image_features.to(dt), text_features.to(dt)  # (b, D) each; no copy for fp32/fp64
        # (N, D) each, gradients flow back to their owners; one collective for both
        all_x, all_y = all_gather_columns_with_grad((x, y), lay.sizes, self.group)
        ls = self.label_smoothing
        if not self.local:
            # Same op order as OpenCLIP's global branch: (scale * X) @ Y^T, texts = its transpose.
            logits = logit_scale * all_x @ all_y.T  # (N, N)
            if logit_bias is not None:
                logits = logits + logit_bias
            labels = torch.arange(lay.total, device=x.device)
            return (
                F.cross_entropy(logits, labels, label_smoothing=ls)
                + F.cross_entropy(logits.T, labels, label_smoothing=ls)
            ) / 2

        logits_img = logit_scale * x @ all_y.T  # (b, N)
        logits_txt = logit_scale * y @ all_x.T  # (b, N)
        if logit_bias is not None:
            logits_img = logits_img + logit_bias
            logits_txt = logits_txt + logit_bias
        labels = torch.arange(lay.local, device=x.device) + lay.offset  # positives sit at global offsets
        if lay.even:  # exactly OpenCLIP's expression (mean over local rows)
            return (
                F.cross_entropy(logits_img, labels, label_smoothing=ls)
                + F.cross_entropy(logits_txt, labels, label_smoothing=ls)
            ) / 2
        # Uneven batches: sum of this rank's rows * world / N, so the mean over ranks is the full loss.
        row_sum = F.cross_entropy(logits_img, labels, label_smoothing=ls, reduction="sum") + F.cross_entropy(
            logits_txt, labels, label_smoothing=ls, reduction="sum"
        )
        return row_sum * (lay.world / (2 * lay.total))
