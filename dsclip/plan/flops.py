"""FLOPs of one training step (``forward_flops``): every matmul, the patch-embedding convolution and attention,
checked against ``torch.utils.flop_counter.FlopCounterMode``; and the loss's (``loss_flops``)."""

from __future__ import annotations

from dsclip.plan.architecture import Arch, Tower


def tower_forward_flops(t: Tower) -> float:
    """Per-sample forward FLOPs of the blocks (2 per multiply-add): qkv, QKᵀ, AV, out-proj, MLP."""
    T, W, H = t.tokens, t.width, t.hidden
    per_block = 2 * T * W * 3 * W + 2 * 2 * T * T * W + 2 * T * W * W + 2 * 2 * T * W * H
    return float(t.layers * per_block)


def forward_flops(arch: Arch) -> dict[str, float]:
    v, t, d = arch.vision, arch.text, arch.embed_dim
    patch = 2.0 * arch.patches * 3 * arch.patch_size**2 * v.width  # conv over every patch (before dropout)
    vision = patch + tower_forward_flops(v) + 2.0 * v.width * d
    text = tower_forward_flops(t) + 2.0 * t.width * d
    return {"vision": vision, "text": text, "total": vision + text}


def loss_flops(mode: str, local_rows: int, global_rows: int, dim: int) -> float:
    """FLOPs of the loss on one rank per step (forward + backward): the logit matmuls dominate.

    infonce computes the whole N×N matrix on every rank; infonce_local two b×N matrices; the tiled
    losses compute each b×N block once and recompute it in backward (4 instead of 3 matmul passes)."""
    b, n, d = float(local_rows), float(global_rows), float(dim)
    one = 2 * b * n * d  # one b×N logit matmul
    if mode == "infonce":
        return 3 * 2 * n * n * d
    if mode == "infonce_local":
        return 3 * 2 * one
    return 4 * one
