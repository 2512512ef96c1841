"""Pieces both towers share: timm's pre-norm ``Block``, the checkpointed block loop, OpenCLIP init.

Both towers use ``timm.models.vision_transformer.Block`` (fused-qkv SDPA attention + MLP), so one key map
(``blocks.N.{norm1, attn.qkv, attn.proj, ls1, norm2, mlp.fc1, mlp.fc2, ls2}``) covers the vision and text
transformers when converting to and from OpenCLIP's ``resblocks.N.*`` layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from timm.layers import QuickGELU
from timm.models.vision_transformer import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

CheckpointFn = Callable[..., Any]  # checkpoint_fn(function, *args) -> function(*args)


def default_checkpoint_fn(function: Callable, *args):
    # Non-reentrant: works with inputs that don't require grad and with ZeRO-2 (reentrant checkpointing
    # has produced "Gradient computed twice for this partition" there).
    return checkpoint(function, *args, use_reentrant=False)


def norm_layer(norm_kwargs: dict | None) -> Callable[..., nn.Module]:
    # OpenCLIP uses torch's LayerNorm (eps 1e-5); timm's default LayerNorm is eps 1e-6.
    return partial(nn.LayerNorm, eps=(norm_kwargs or {}).get("eps", 1e-5))


def act_layer(quick_gelu: bool) -> type[nn.Module]:
    return QuickGELU if quick_gelu else nn.GELU


def make_blocks(
    width: int,
    layers: int,
    heads: int,
    mlp_ratio: float,
    ls_init_value: float | None,
    quick_gelu: bool,
    norm_kwargs: dict | None,
) -> nn.Sequential:
    return nn.Sequential(
        *[
            Block(
                dim=width,
                num_heads=heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=True,  # nn.MultiheadAttention's in_proj_bias
                proj_bias=True,
                init_values=ls_init_value,
                norm_layer=norm_layer(norm_kwargs),
                act_layer=act_layer(quick_gelu),
                depth=i,
            )
            for i in range(layers)
        ]
    )


def run_blocks(
    blocks: nn.Sequential, x: torch.Tensor, checkpoint_fn: CheckpointFn | None, is_causal: bool = False
) -> torch.Tensor:
    """x (B, T, W) through every block; each block through checkpoint_fn when one is given."""
    use_ckpt = checkpoint_fn is not None and torch.is_grad_enabled()
    for blk in blocks:
        fn = partial(blk, is_causal=True) if is_causal else blk
        x = checkpoint_fn(fn, x) if use_ckpt else fn(x)
    return x


@torch.no_grad()
def reset_block(block: Block, attn_std: float | None, proj_std: float | None, fc_std: float | None) -> None:
    """OpenCLIP's block init. ``None`` stds leave torch's defaults, as OpenCLIP does for the vision tower
    (nn.MultiheadAttention: xavier-uniform in_proj, zero biases; nn.Linear defaults for the rest)."""
    for m in block.modules():
        if m is not block and hasattr(m, "reset_parameters"):
            m.reset_parameters()  # nn.Linear / nn.LayerNorm defaults, LayerScale gamma = init_values
    if attn_std is None:
        nn.init.xavier_uniform_(block.attn.qkv.weight)
    else:
        nn.init.normal_(block.attn.qkv.weight, std=attn_std)
    nn.init.zeros_(block.attn.qkv.bias)
    nn.init.zeros_(block.attn.proj.bias)
    if proj_std is not None:
        nn.init.normal_(block.attn.proj.weight, std=proj_std)
        nn.init.normal_(block.mlp.fc2.weight, std=proj_std)
    if fc_std is not None:
        nn.init.normal_(block.mlp.fc1.weight, std=fc_std)
