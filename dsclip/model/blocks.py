"""Pieces both towers share: timm's pre-norm ``Block``, the checkpointed block loop, OpenCLIP init.

Both towers use ``timm.models.vision_transformer.Block`` (fused-qkv SDPA attention + MLP), so one key map
(``blocks.N.{norm1, attn.qkv, attn.proj, ls1, norm2, mlp.fc1, mlp.fc2, ls2}``) covers the vision and text
transformers when converting to and from OpenCLIP's ``resblocks.N.*`` layout.
"""

from __future__ import annotations

import contextlib
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


def act_layer(quick_gelu: bool, act_kwargs: dict | None = None) -> Callable[..., nn.Module]:
    # act_kwargs: OpenCLIP's text_cfg.act_kwargs, e.g. SigLIP 2's {"approximate": "tanh"} GELU
    if quick_gelu:
        return QuickGELU
    return partial(nn.GELU, **act_kwargs) if act_kwargs else nn.GELU


def make_blocks(
    width: int,
    layers: int,
    heads: int,
    mlp_ratio: float,
    ls_init_value: float | None,
    quick_gelu: bool,
    norm_kwargs: dict | None,
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
    drop_path_rate: float = 0.0,
    act_kwargs: dict | None = None,
) -> nn.Sequential:
    # Stochastic depth grows linearly with depth, as in timm's VisionTransformer.
    dpr = [drop_path_rate * i / max(layers - 1, 1) for i in range(layers)]
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
                act_layer=act_layer(quick_gelu, act_kwargs),
                proj_drop=dropout,
                attn_drop=attn_dropout,
                drop_path=dpr[i],
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


InitPlan = list[tuple[nn.Module, Callable[[], None]]]  # (module, fn touching only module's own params)
GatherFn = Callable[[list[nn.Parameter]], contextlib.AbstractContextManager]


def is_materialized(p: torch.Tensor) -> bool:
    # A ZeRO-3 partitioned parameter is an empty placeholder whose real shape is in `ds_shape`
    # (duck-typed so this package never imports deepspeed).
    ds_shape = getattr(p, "ds_shape", None)
    return ds_shape is None or tuple(p.shape) == tuple(ds_shape)


@torch.no_grad()
def apply_init_plan(plan: InitPlan, gather: GatherFn | None = None) -> int:
    """Run each init fn whose module's own parameters are materialised; returns how many were skipped.

    ``gather(params)`` is a context manager that materialises (and afterwards re-partitions) params,
    e.g. ``lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0)``; one module at a time,
    so memory stays bounded by the largest single layer."""
    skipped = 0
    for module, fn in plan:
        params = list(module.parameters(recurse=False))
        with gather(params) if gather is not None and params else contextlib.nullcontext():
            if all(is_materialized(p) for p in params):
                fn()
            else:
                skipped += 1
    return skipped


def block_init_plan(block: Block, attn_std: float | None, proj_std: float | None, fc_std: float | None) -> InitPlan:
    """OpenCLIP's block init. ``None`` stds keep torch's defaults, as OpenCLIP does for the vision tower
    (nn.MultiheadAttention: xavier-uniform in_proj, zero biases; nn.Linear defaults for the MLP)."""
    attn, mlp = block.attn, block.mlp

    def qkv():
        if attn_std is None:
            nn.init.xavier_uniform_(attn.qkv.weight)
        else:
            nn.init.normal_(attn.qkv.weight, std=attn_std)
        nn.init.zeros_(attn.qkv.bias)

    def out_proj():
        attn.proj.reset_parameters()
        if proj_std is not None:
            nn.init.normal_(attn.proj.weight, std=proj_std)
        nn.init.zeros_(attn.proj.bias)

    def linear(layer: nn.Linear, std: float | None):
        def fn():
            layer.reset_parameters()  # bias: torch's uniform default, as OpenCLIP leaves it
            if std is not None:
                nn.init.normal_(layer.weight, std=std)

        return fn

    plan: InitPlan = [(attn.qkv, qkv), (attn.proj, out_proj), (mlp.fc1, linear(mlp.fc1, fc_std))]
    plan.append((mlp.fc2, linear(mlp.fc2, proj_std)))
    for m in (block.norm1, block.norm2, block.ls1, block.ls2):
        if hasattr(m, "reset_parameters"):  # LayerNorm; LayerScale (gamma = init_values)
            plan.append((m, m.reset_parameters))
    return plan
