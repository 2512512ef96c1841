"""InfoNCE plus distillation from a frozen teacher CLIP: OpenCLIP's ``DistillClipLoss``, exact across ranks.

OpenCLIP (``--distill-model`` / ``--distill-pretrained``) returns two terms that its trainer adds:

    contrastive = ClipLoss on the student's logits
    distill     = 1/2 [ CE(softmax(T_img), S_img) + CE(softmax(T_txt), S_txt) ],
                  CE(p, z) = -(p * log_softmax(z)).sum(1).mean(0) over rows

where S / T are the student's / teacher's logit matrices, both built by ``ClipLoss.get_logits`` from
features gathered the same way: global mode N x N on every rank, local mode this rank's b rows against
all N columns. Only the logits are compared, so the teacher's embedding width may differ from the
student's. The teacher's features and scale carry no gradient (the teacher is frozen).

Same per-rank convention as every dsclip loss (see ``dsclip.losses``): the mean over ranks of the
returned value is the full-batch ``contrastive + distill``; uneven local batches weight row sums by
world / N. ``label_smoothing`` applies to the contrastive cross-entropies only (OpenCLIP has none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import LossInputError, acc_dtype, check_inputs
from .distributed import all_gather_columns_with_grad
from .infonce import InfoNCELoss


def soft_cross_entropy(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """Per row: -(softmax(teacher) * log_softmax(student)).sum(1) (OpenCLIP's ``dist_loss`` before its mean)."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1)


class DistillInfoNCELoss(InfoNCELoss):
    """``InfoNCELoss`` (global or local) + OpenCLIP's distillation term on the teacher's logits.

    Called as ``loss(img, txt, logit_scale, logit_bias=None, *, teacher_image_features,
    teacher_text_features, teacher_logit_scale)`` with this rank's rows of both models (same rows,
    same order); the teacher tensors are detached here. ``last_terms`` holds the detached
    parts of the last call, ``contrastive_loss`` and ``distill_loss`` (OpenCLIP's log names; their sum is
    the value), for logging.
    """

    last_terms: dict[str, Tensor] | None = None

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None = None,
        *,
        teacher_image_features: Tensor,
        teacher_text_features: Tensor,
        teacher_logit_scale: Tensor,
    ) -> Tensor:
        kw = dict(group=self.group, check_finite=self.check_finite)
        lay = check_inputs(image_features, text_features, logit_scale, logit_bias, **kw)
        t_lay = check_inputs(teacher_image_features, teacher_text_features, teacher_logit_scale, None, **kw)
        if t_lay.sizes != lay.sizes:  # both layouts are gathered tables: every rank raises together
            raise LossInputError(
                f"distillation: teacher rows per rank {t_lay.sizes} != student rows per rank {lay.sizes}; "
                "the teacher must embed exactly the student's batch"
            )
        dt = acc_dtype(image_features.dtype)
        x, y = image_features.to(dt), text_features.to(dt)  # (b, D)
        # the teacher is frozen (detached: no gradient reaches it); student and teacher rows in one collective
        tx, ty = teacher_image_features.detach().to(dt), teacher_text_features.detach().to(dt)  # (b, Dt)
        all_x, all_y, all_tx, all_ty = all_gather_columns_with_grad((x, y, tx, ty), lay.sizes, self.group)
        all_tx, all_ty = all_tx.detach(), all_ty.detach()  # (N, Dt)
        t_scale = torch.as_tensor(teacher_logit_scale).detach().to(dt).reshape(())
        gathered = (all_x, all_y, all_tx, all_ty)
        if self.local:
            contrastive, distill = self._local_terms(logit_scale, logit_bias, t_scale, (x, y, tx, ty), gathered, lay)
        else:
            contrastive, distill = self._global_terms(logit_scale, logit_bias, t_scale, gathered, lay)
        self.last_terms = {"contrastive_loss": contrastive.detach(), "distill_loss": distill.detach()}
        return contrastive + distill

    def _global_terms(self, logit_scale, logit_bias, t_scale, gathered, lay):
        """(contrastive, distill) as OpenCLIP's global branch for both models: (scale * X) @ Y^T over all N
        rows, the text logits its transpose. ``gathered``: all ranks' student image/text and teacher
        image/text rows."""
        all_x, all_y, all_tx, all_ty = gathered
        ls = self.label_smoothing
        logits = logit_scale * all_x @ all_y.T  # (N, N)
        if logit_bias is not None:
            logits = logits + logit_bias
        t_logits = t_scale * all_tx @ all_ty.T  # (N, N)
        labels = torch.arange(lay.total, device=all_x.device)
        contrastive = (
            F.cross_entropy(logits, labels, label_smoothing=ls) + F.cross_entropy(logits.T, labels, label_smoothing=ls)
        ) / 2
        distill = (soft_cross_entropy(t_logits, logits).mean() + soft_cross_entropy(t_logits.T, logits.T).mean()) / 2
        return contrastive, distill

    def _local_terms(self, logit_scale, logit_bias, t_scale, local, gathered, lay):
        """(contrastive, distill) from this rank's rows (``local``) against all N (``gathered``), for
        ``local_loss``: the rank's share, whose mean over ranks is the full loss."""
        x, y, tx, ty = local
        all_x, all_y, all_tx, all_ty = gathered
        ls = self.label_smoothing
        logits_img = logit_scale * x @ all_y.T  # (b, N)
        logits_txt = logit_scale * y @ all_x.T  # (b, N)
        if logit_bias is not None:
            logits_img = logits_img + logit_bias
            logits_txt = logits_txt + logit_bias
        t_img = t_scale * tx @ all_ty.T  # (b, N)
        t_txt = t_scale * ty @ all_tx.T  # (b, N)
        labels = torch.arange(lay.local, device=x.device) + lay.offset  # positives sit at global offsets
        contrastive_rows = F.cross_entropy(logits_img, labels, label_smoothing=ls, reduction="none") + F.cross_entropy(
            logits_txt, labels, label_smoothing=ls, reduction="none"
        )  # (b,)
        distill_rows = soft_cross_entropy(t_img, logits_img) + soft_cross_entropy(t_txt, logits_txt)  # (b,)
        # Even batches: OpenCLIP's expression, means over this rank's rows. Uneven: sums of this rank's rows
        # * world / N, so the mean over ranks is the full loss.
        weight = 1 / (2 * lay.local) if lay.even else lay.world / (2 * lay.total)
        contrastive, distill = contrastive_rows.sum() * weight, distill_rows.sum() * weight
        return contrastive, distill
