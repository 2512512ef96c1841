"""Input validation shared by every loss: one small collective that every rank runs first.

Why: a loss whose ranks disagree about shapes (or where one rank holds NaNs) must fail on EVERY rank
with the same message instead of leaving the healthy ranks blocked in a collective. So each rank
packs its local facts (shapes, dtypes, a finite flag) into a tiny tensor, all ranks all-gather it,
and every rank applies the same checks to the same gathered table. The gathered batch sizes are
needed anyway (uneven last batches), so the check costs one tiny all-gather per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dsclip.dist import rank_world

from .distributed import _all_gather_single

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_N_META = 11


class LossInputError(ValueError):
    """Bad loss inputs on at least one rank; raised identically on every rank."""


@dataclass(frozen=True)
class BatchLayout:
    """Where this rank's rows sit in the global batch (rank order)."""

    rank: int
    world: int
    sizes: tuple[int, ...]  # every rank's local batch size

    @property
    def total(self) -> int:  # global batch N
        return sum(self.sizes)

    @property
    def offset(self) -> int:  # first global row index of this rank
        return sum(self.sizes[: self.rank])

    @property
    def local(self) -> int:
        return self.sizes[self.rank]

    @property
    def even(self) -> bool:
        return all(s == self.sizes[0] for s in self.sizes)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, the input dtype otherwise (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _nonfinite(t: Tensor | None) -> bool:
    # A float64 sum is non-finite iff some element is NaN/Inf (finite fp16/bf16/fp32 values cannot
    # overflow a float64 sum) and it allocates nothing of the input's size.
    return t is not None and t.numel() > 0 and not bool(torch.isfinite(t.sum(dtype=torch.float64)))


def _local_meta(img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor | None, check_finite: bool) -> list:
    def shape3(t):
        return [t.dim(), t.shape[0] if t.dim() >= 1 else -1, t.shape[1] if t.dim() == 2 else -1]

    flags = 0
    if check_finite:
        flags |= 1 * _nonfinite(img) | 2 * _nonfinite(txt) | 4 * _nonfinite(scale) | 8 * _nonfinite(bias)
    return [
        *shape3(img),
        *shape3(txt),
        _code(img.dtype),
        _code(txt.dtype),
        flags,
        scale.numel(),
        -1 if bias is None else bias.numel(),
    ]


def _verdict(table: list[list[int]]) -> str | None:
    """Same table on every rank -> same message on every rank."""
    names = {v: str(d).replace("torch.", "") for v, d in enumerate(_DTYPES)}
    problems = []
    for r, (ni, bi, di, nt, bt, dt, ci, ct, flags, ns, nb) in enumerate(table):
        if ni != 2 or nt != 2:
            problems.append(f"rank {r}: features must be 2-D (b, D), got {ni}-D image / {nt}-D text")
            continue
        if bi != bt or di != dt:
            problems.append(f"rank {r}: image features ({bi}, {di}) vs text features ({bt}, {dt})")
        if ci < 0 or ct < 0:
            problems.append(f"rank {r}: features must be float16/bfloat16/float32/float64")
        elif ci != ct:
            problems.append(f"rank {r}: image dtype {names[ci]} != text dtype {names[ct]}")
        if ns != 1:
            problems.append(f"rank {r}: logit_scale must hold one value, got {ns}")
        if nb not in (-1, 1):
            problems.append(f"rank {r}: logit_bias must hold one value, got {nb}")
        bad = [
            n
            for bit, n in ((1, "image features"), (2, "text features"), (4, "logit_scale"), (8, "logit_bias"))
            if flags & bit
        ]
        if bad:
            problems.append(f"rank {r}: non-finite values (NaN/Inf) in {', '.join(bad)}")
    if problems:
        return "; ".join(problems)
    dims = sorted({row[2] for row in table})
    if len(dims) > 1:
        per = ", ".join(f"rank {r}: D={row[2]}" for r, row in enumerate(table))
        problems.append(f"embedding dim differs across ranks ({per})")
    codes = sorted({row[6] for row in table})
    if len(codes) > 1:
        per = ", ".join(f"rank {r}: {names[row[6]]}" for r, row in enumerate(table))
        problems.append(f"feature dtype differs across ranks ({per})")
    if len({row[10] == -1 for row in table}) > 1:
        problems.append("logit_bias is given on some ranks and None on others")
    if sum(row[1] for row in table) == 0:
        problems.append("the global batch is empty")
    return "; ".join(problems) or None


def check_inputs(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    *,
    group=None,
    check_finite: bool = True,
) -> BatchLayout:
    """Validate the inputs of every rank (one tiny all-gather) and return the global batch layout.

    Raises :class:`LossInputError` with the same message on all ranks when any rank's inputs are
    malformed (shape, dtype, NaN/Inf when ``check_finite``) or the ranks disagree (D, dtype, bias).
    """
    rank, world = rank_world(group)
    scale = torch.as_tensor(logit_scale)
    bias = None if logit_bias is None else torch.as_tensor(logit_bias)
    meta = _local_meta(image_features, text_features, scale, bias, check_finite)
    if world == 1:
        table = [meta]
    else:
        t = torch.tensor(meta, dtype=torch.int64, device=image_features.device)
        out = torch.empty(world * _N_META, dtype=torch.int64, device=image_features.device)
        _all_gather_single(out, t, group=group)
        table = out.view(world, _N_META).tolist()
    msg = _verdict(table)
    if msg is not None:
        raise LossInputError(f"contrastive loss inputs rejected on all {world} rank(s): {msg}")
    return BatchLayout(rank=rank, world=world, sizes=tuple(int(row[1]) for row in table))


class ContrastiveLoss(nn.Module):
    """Front door shared by every loss: validate the inputs on all ranks together, then compute.

    ``check_inputs`` exchanges a tiny metadata tensor first, so a bad input on any rank raises on
    every rank instead of leaving the others blocked in a collective. Subclasses implement
    ``compute(image_features, text_features, logit_scale, logit_bias, layout)``.
    """

    def __init__(self, *, check_finite: bool = True, group=None):
        super().__init__()
        self.check_finite = check_finite
        self.group = group

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None = None,
    ) -> Tensor:
        layout = check_inputs(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            group=self.group,
            check_finite=self.check_finite,
        )
        return self.compute(image_features, text_features, logit_scale, logit_bias, layout)

    def compute(self, image_features, text_features, logit_scale, logit_bias, layout: BatchLayout) -> Tensor:
        raise NotImplementedError


def check_label_smoothing(label_smoothing: float) -> float:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return float(label_smoothing)
