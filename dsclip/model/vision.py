"""Image tower: timm's ``VisionTransformer`` with CLIP settings plus OpenCLIP's bias-free projection.

CLIP settings: class token, pre-norm (``norm_pre``, and no patch-embed bias), final norm before token
pooling, LayerNorm eps 1e-5, qkv bias, no classifier head. The projection ``proj`` is a (width, embed)
parameter used as ``x @ proj`` exactly like OpenCLIP's ``visual.proj``, so conversion is a rename.
The block loop is written here (not timm's ``checkpoint_seq``) so the engine can inject DeepSpeed's
activation checkpointing.
"""

from __future__ import annotations

import torch
from timm.layers import PatchDropout as _TimmPatchDropout
from timm.layers.patch_dropout import patch_dropout_forward
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from .blocks import (
    CheckpointFn,
    InitPlan,
    act_layer,
    apply_init_plan,
    block_init_plan,
    default_checkpoint_fn,
    norm_layer,
    run_blocks,
)


class PatchDropout(_TimmPatchDropout):
    """timm's PatchDropout (class token kept) that can also run in eval mode (``force=True``)."""

    def __init__(self, prob: float = 0.0, num_prefix_tokens: int = 1, force: bool = False):
        super().__init__(prob, num_prefix_tokens=num_prefix_tokens)
        self.force = force

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1 + N, W) -> (B, 1 + keep, W)
        out, _ = patch_dropout_forward(x, self.prob, self.num_prefix_tokens, self.ordered, self.training or self.force)
        return out

    def extra_repr(self) -> str:
        return f"prob={self.prob}, force={self.force}"


class VisionTower(VisionTransformer):
    def __init__(
        self,
        *,
        embed_dim: int,
        image_size: int = 224,
        patch_size: int = 16,
        width: int = 768,
        layers: int = 12,
        head_width: int = 64,
        mlp_ratio: float = 4.0,
        patch_dropout: float = 0.0,
        ls_init_value: float | None = None,
        norm_kwargs: dict | None = None,
        quick_gelu: bool = False,
        force_patch_dropout: bool = False,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        timm_layout: dict | None = None,
        project: bool = True,
    ):
        # timm_layout (dsclip.model.timm_vit.timm_vit_spec): one of timm's own ViTs, e.g. SigLIP's (no class
        # token, no pre-norm, a 'map' attention-pool head, timm's LayerNorm and init); None: OpenCLIP's ViT.
        layout = timm_layout or {}
        self.timm_layout = timm_layout
        super().__init__(
            img_size=image_size,
            patch_size=patch_size,
            num_classes=0,
            embed_dim=width,
            depth=layers,
            num_heads=width // head_width,
            mlp_ratio=mlp_ratio,
            qkv_bias=True,
            init_values=ls_init_value,
            class_token=layout.get("class_token", True),
            pre_norm=layout.get("pre_norm", True),  # adds norm_pre (OpenCLIP ln_pre) and drops the patch-embed bias
            final_norm=layout.get("final_norm", True),
            fc_norm=layout.get("fc_norm", False),
            global_pool=layout.get("global_pool", "token"),
            norm_layer=norm_layer(norm_kwargs),
            act_layer=act_layer(quick_gelu) if timm_layout is None else timm_layout["act_layer"],
            weight_init="skip",  # init below (OpenCLIP's, or timm's for a timm layout)
            proj_drop_rate=dropout,
            attn_drop_rate=attn_dropout,
            drop_path_rate=drop_path_rate,
            # blocks: timm's default Block (qkv bias, proj bias), the same class text.py uses
        )
        self._add_head(embed_dim, width, patch_dropout, force_patch_dropout, project)
        self.width = width
        self.output_dim = embed_dim
        self.checkpoint_fn: CheckpointFn | None = None
        # Under ZeRO-3 zero.Init child layers are already partitioned here and get skipped;
        # CLIP.init_weights(gather=...) completes the init (see its docstring).
        self.init_skipped = apply_init_plan(self.init_plan())

    def _add_head(self, embed_dim: int, width: int, patch_dropout: float, force: bool, project: bool) -> None:
        """Patch dropout (always present, a no-op at prob 0, so create_model / set_patch_dropout can change it
        later) and the projection to the embedding: OpenCLIP's visual.proj (or a timm tower's head.proj),
        absent for timm_proj 'none' (width = embed_dim)."""
        self.patch_drop = PatchDropout(patch_dropout, num_prefix_tokens=self.num_prefix_tokens, force=force)
        if not project and width != embed_dim:
            raise ValueError(f"a vision tower without projection needs width == embed_dim, got {width} vs {embed_dim}")
        self.proj = nn.Parameter(torch.empty(width, embed_dim)) if project else None

    def init_plan(self) -> InitPlan:
        return self._openclip_init_plan() if self.timm_layout is None else self._timm_init_plan()

    def _timm_init_plan(self) -> InitPlan:
        # timm's VisionTransformer.init_weights('') (what OpenCLIP's TimmModel gets): trunc-normal(.02)
        # positions, normal(1e-6) class token, every Linear trunc-normal(.02) with zero bias, modules with
        # their own init_weights (the attention pool's latent), torch defaults elsewhere (conv, LayerNorm).
        from timm.layers import trunc_normal_

        def own():
            trunc_normal_(self.pos_embed, std=0.02)
            if self.cls_token is not None:
                nn.init.normal_(self.cls_token, std=1e-6)
            if self.proj is not None:  # OpenCLIP's head.proj is an nn.Linear left at torch's default init
                bound = self.width**-0.5
                nn.init.uniform_(self.proj, -bound, bound)

        def linear(layer: nn.Linear):
            def fn():
                trunc_normal_(layer.weight, std=0.02)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

            return fn

        plan: InitPlan = [(self, own)]
        for module in self.modules():
            if module is self or not list(module.parameters(recurse=False)):
                continue
            if isinstance(module, nn.Linear):
                plan.append((module, linear(module)))
            elif hasattr(module, "init_weights") and not isinstance(module, nn.Sequential):
                plan.append((module, module.init_weights))
            elif hasattr(module, "reset_parameters"):
                plan.append((module, module.reset_parameters))
        return plan

    def _openclip_init_plan(self) -> InitPlan:
        # OpenCLIP's VisionTransformer: scale * randn for class/positional embeddings and proj; the blocks
        # keep nn.MultiheadAttention / nn.Linear defaults (OpenCLIP defines no vision block init).
        scale = self.width**-0.5

        def own():
            for p in (self.cls_token, self.pos_embed, self.proj):
                nn.init.normal_(p, std=scale)

        plan: InitPlan = [(self, own), (self.patch_embed.proj, self.patch_embed.proj.reset_parameters)]
        plan += [(self.norm_pre, self.norm_pre.reset_parameters), (self.norm, self.norm.reset_parameters)]
        for blk in self.blocks:
            plan += block_init_plan(blk, attn_std=None, proj_std=None, fc_std=None)
        return plan

    def set_grad_checkpointing(self, enable: bool = True, checkpoint_fn: CheckpointFn | None = None) -> None:
        self.grad_checkpointing = enable
        self.checkpoint_fn = (checkpoint_fn or default_checkpoint_fn) if enable else None

    def set_patch_dropout(self, prob: float | None = None, force: bool | None = None) -> None:
        if prob is not None:
            if not 0.0 <= prob < 1.0:
                raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
            self.patch_drop.prob = float(prob)
        if force is not None:
            self.patch_drop.force = bool(force)

    def no_weight_decay(self) -> set[str]:
        return {"cls_token", "pos_embed"}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 1 + keep, W)
        x = self.patch_embed(x)  # (B, N, W)
        x = self._pos_embed(x)  # (B, 1 + N, W): class token prepended, positions added
        x = self.patch_drop(x)  # (B, 1 + keep, W)
        x = self.norm_pre(x)
        x = run_blocks(self.blocks, x, self.checkpoint_fn if self.grad_checkpointing else None)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, D)
        x = self.forward_features(x)
        x = self.pool(x)  # (B, W): class token (OpenCLIP's ViT), or timm's pool ('map': attention pool)
        x = self.fc_norm(x)  # Identity unless the timm layout pools by average
        return x if self.proj is None else x @ self.proj
