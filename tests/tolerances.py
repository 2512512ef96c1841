"""Tolerances of the numerical tests, derived from floating-point arithmetic: one home for the derivations.

Two correct computations of the same quantity differ only in rounding, mostly in the order in which
sums are taken: the ATen kernel family (default, AVX2, AVX-512) and the thread count choose how a
matmul or a reduction is blocked, and the gradient cache and the all-reduce split one batch sum into
pieces. A tolerance tuned on one machine captures that machine's order; the ones below hold for any.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 and §4.2): a float sum
of n terms, in any order, is within gamma_n * sum|x_i| of the exact sum, gamma_n = n*u/(1 - n*u),
u = eps/2 the unit roundoff. Results computed through a chain of sums of n_1, n_2, ... terms carry,
to first order, relative error (n_1 + n_2 + ...)*u with respect to the sizes of their terms.
- `worst_case(n, size)`: that bound, n*u*size. Two orders differ by at most twice it.
- `rounding(n, size)`: the statistical size of the same error. The individual rounding errors have
  random signs, so they add like a random walk: sqrt(n)*u*size is the typical size; K_SIGMA times it
  is never exceeded in practice. Used where the worst case (thousands of chained terms in a network
  gradient) would be so loose that it hides a relative error of 1e-4, which the checks must catch.
Each test names n (which sums) and size (how big their terms are) next to its tolerance.
"""

from __future__ import annotations

import math

import torch

# Higher than a Gaussian's 3-4 sigma because maxima are taken over up to ~10^5 compared elements.
K_SIGMA = 6.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: float32 6.0e-8, float64 1.1e-16, bfloat16 3.9e-3."""
    return torch.finfo(dtype).eps / 2


def worst_case(n: int, size: float, dtype: torch.dtype = torch.float32) -> float:
    """Largest difference between two summation orders of n terms whose magnitudes add up to `size`."""
    u = unit_roundoff(dtype)
    return 2 * n * u / (1 - n * u) * size


def rounding(n: int, size: float, dtype: torch.dtype = torch.float32) -> float:
    """K_SIGMA times the random-walk size sqrt(n)*u*size of the same difference (both orders: sqrt 2)."""
    return K_SIGMA * math.sqrt(2 * n) * unit_roundoff(dtype) * size


def loss_terms(n: int, d: int) -> int:
    """Chained sum lengths of a contrastive loss over n pairs of d-dim unit features, and its gradients.

    logits: d-term dot products; log-sum-exp / log-sigmoid: n terms per row or column, plus a few
    roundings for exp, log and the subtraction of the max (8 covers them: each is within 1-2 ulp);
    the means over rows and columns: n terms; the logit-scale (and bias) gradient sums over all n*n
    logits. So n*n + 2n + d + 8 chained terms bound every output."""
    return n * n + 2 * n + d + 8


def loss_size(n: int, scale: float, bias: float = 0.0) -> float:
    """Magnitude of the terms: logits are at most |scale| + |bias| (unit vectors); log-sum-exp adds log n;
    per-pair loss terms and gradients are bounded by the same (probabilities are at most 1)."""
    return abs(scale) + abs(bias) + math.log(n) + 1.0


def loss_tol(n: int, d: int, scale: float, bias: float = 0.0, dtype: torch.dtype = torch.float64) -> float:
    """Worst-case tolerance for a loss value or gradient, n pairs, d dims (see loss_terms, loss_size)."""
    return worst_case(loss_terms(n, d), loss_size(n, scale, bias), dtype)


def adam_first_step_sensitivity(g: torch.Tensor, gtol: torch.Tensor | float, lr: float, eps: float) -> torch.Tensor:
    """Largest change of Adam's (and AdamW's) first-step update per unit change of the gradient, per element.

    The first step moves w by lr * m/(sqrt(v) + eps) = lr * g/(|g| + eps) (bias corrections cancel), whose
    derivative lr * eps/(|g| + eps)^2 peaks at g = 0 (lr/eps). Over a gradient interval g +- gtol the
    steepest point is the one nearest 0."""
    nearest_zero = (g.abs() - gtol).clamp(min=0)
    return lr * eps / (nearest_zero + eps) ** 2


def tower_tokens(cfg: dict) -> dict[str, int]:
    """Sequence lengths of an OpenCLIP-schema model config: patches + class token, and the text context."""
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    return {"vision_cfg": (v["image_size"] // v["patch_size"]) ** 2 + 1, "text_cfg": t["context_length"]}


def forward_terms(cfg: dict) -> int:
    """Chained sum lengths of one forward pass of a CLIP model (OpenCLIP-schema config dict).

    Per transformer block of width W, MLP ratio r and T tokens: the contractions of qkv, q·k (head
    dim <= W), attention·v (T), out-proj, fc1 and fc2 (r·W), the softmax's sum (T) and two LayerNorms'
    mean and variance (4W): (8 + r)·W + 2T. Per tower add the final norm and projection (2W)."""
    n = 0
    for tower, tokens in tower_tokens(cfg).items():
        c = cfg[tower]
        w, r = c["width"], c.get("mlp_ratio", 4.0)
        n += int(c["layers"] * ((8 + r) * w + 2 * tokens) + 2 * w)
    return n


def embedding_tol(cfg: dict, size: float = 1.0) -> float:
    """Two implementations (or kernels) embedding the same inputs with the same fp32 weights: rounding over
    forward_terms, terms of the embeddings' size (1 for L2-normalised ones, else their largest entry)."""
    return rounding(forward_terms(cfg), size)
