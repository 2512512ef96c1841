"""OpenCLIP's timm image towers (``vision_cfg.timm_model_name``) that dsclip builds itself: timm ViTs.

OpenCLIP's ``TimmModel`` calls ``timm.create_model(name, num_classes=0, global_pool=timm_pool)`` and keeps
the result as ``visual.trunk``; SigLIP's towers (``vit_base_patch16_siglip_224`` ... ``vit_so400m_*``) are
timm ``VisionTransformer``s with no class token, no pre-norm and a ``map`` attention-pool head. dsclip
builds the same network as its own ``VisionTower`` (a ``VisionTransformer`` subclass with dsclip's
block loop, patch dropout and ZeRO-3-aware init), so the parameter names are timm's and conversion to
OpenCLIP is a ``visual.`` <-> ``visual.trunk.`` rename.

The tower's numbers are read from the installed timm, not copied into a table: the named model is
built on the meta device (no memory, ~0.1-0.4 s) and measured. Anything that model has which
``VisionTower`` does not build (register tokens, qk-norm, another block type, ...) is refused by name.
"""

from __future__ import annotations

import functools
from typing import Any

# OpenCLIP TimmModel options dsclip builds for a timm ViT (``timm_proj``: 'none' keeps the trunk's
# width as the embedding, 'linear' is a bias-free (width, embed) projection, as OpenCLIP's head.proj).
TIMM_POOLS = ("map", "avg", "token")
TIMM_PROJS = ("none", "linear")


def _meta_trunk(name: str, pool: str, proj: str):
    """timm's ``name`` on the meta device, built as OpenCLIP's TimmModel builds its trunk (see timm_vit_spec).
    Raises ValueError for a pool, name or model class dsclip cannot build."""
    import timm
    import torch
    from timm.models.vision_transformer import VisionTransformer

    if pool not in TIMM_POOLS:
        raise ValueError(f"vision_cfg.timm_pool={pool!r}: dsclip builds timm ViT pools {TIMM_POOLS}")
    if not timm.is_model(name):
        raise ValueError(f"vision_cfg.timm_model_name={name!r} is not a model of the installed timm {timm.__version__}")
    with torch.device("meta"):
        if proj == "none":
            m = timm.create_model(name, pretrained=False, num_classes=0, global_pool=pool)
        else:
            m = timm.create_model(name, pretrained=False)
    if proj != "none" and isinstance(m, VisionTransformer):
        if pool in ("map",) and m.attn_pool is None:  # timm cannot add an attention pool after the fact
            raise ValueError(
                f"vision_cfg.timm_pool='map' with timm_proj={proj!r}: OpenCLIP cannot build it for {name!r}"
            )
        with torch.device("meta"):
            m.reset_classifier(0, global_pool=pool)
    if type(m) is not VisionTransformer:
        raise ValueError(
            f"vision tower timm:{name} (a timm {type(m).__name__}; dsclip builds timm VisionTransformer towers, "
            "e.g. the SigLIP ViTs)"
        )
    return m


def _final_norm(m):
    """The trunk's last norm: ``norm`` (before pooling) or, where that is Identity, ``fc_norm`` (after)."""
    from torch import nn

    return m.norm if not isinstance(m.norm, nn.Identity) else m.fc_norm


def _unsupported(m) -> list[str]:
    """What the timm ViT ``m`` has that dsclip's VisionTower does not build, by name."""
    from timm.layers import GELUTanh
    from timm.models.vision_transformer import Block
    from torch import nn

    blk = m.blocks[0]
    act = blk.mlp.act
    unsupported = {
        "register tokens": m.num_reg_tokens > 0,
        "no_embed_class": m.no_embed_class,
        "dynamic image size": m.dynamic_img_size,
        f"{type(blk).__name__} blocks": any(type(b) is not Block for b in m.blocks),
        "qk-norm": not isinstance(blk.attn.q_norm, nn.Identity),
        "an attention norm": not isinstance(getattr(blk.attn, "norm", nn.Identity()), nn.Identity),
        "qkv without bias": blk.attn.qkv.bias is None,
        "layer scale": not isinstance(blk.ls1, nn.Identity),
        "a patch-embed norm": not isinstance(m.patch_embed.norm, nn.Identity),
        f"activation {type(act).__name__}": type(act) not in (nn.GELU, GELUTanh),
        # timm's LayerNorm subclass computes F.layer_norm like torch's, which dsclip builds
        "a norm that is not LayerNorm": not isinstance(_final_norm(m), nn.LayerNorm),
    }
    return [what for what, present in unsupported.items() if present]


def _mlp_ratio(width: int, hidden: int) -> float:
    """timm sizes the MLP as int(width * mlp_ratio): a ratio that gives back exactly this hidden size."""
    mlp_ratio = round(hidden / width, 6)
    if int(width * mlp_ratio) != hidden:
        mlp_ratio = (hidden + 0.25) / width
    return mlp_ratio


@functools.cache
def timm_vit_spec(name: str, pool: str, proj: str = "none") -> dict[str, Any]:
    """What ``VisionTower`` needs to build timm's ``name`` as OpenCLIP's TimmModel builds it, measured on
    the meta device. Raises ValueError naming what dsclip cannot build.

    TimmModel builds the trunk two ways: with ``timm_proj`` 'none' as ``create_model(name, num_classes=0,
    global_pool=pool)`` (timm picks norms for that pool: 'avg' gets an fc_norm and no final norm), with a
    projection as ``create_model(name)`` then ``reset_classifier(0, global_pool=pool)`` (the norms of
    the model's default pool stay). Both are mirrored here, so the tower has OpenCLIP's exact tensors."""
    from torch import nn

    m = _meta_trunk(name, pool, proj)
    bad = _unsupported(m)
    if bad:
        raise ValueError(f"vision_cfg.timm_model_name={name!r} has {', '.join(bad)}: dsclip's ViT does not build it")
    blk = m.blocks[0]
    width = m.embed_dim
    return {
        "image_size": int(m.patch_embed.img_size[0]),
        "patch_size": int(m.patch_embed.patch_size[0]),
        "width": int(width),
        "layers": len(m.blocks),
        "head_width": int(width // blk.attn.num_heads),
        "mlp_ratio": _mlp_ratio(width, blk.mlp.fc1.out_features),
        "norm_eps": float(_final_norm(m).eps),
        "act_layer": type(blk.mlp.act),  # nn.GELU, or timm's GELUTanh (SigLIP 2's patch-16 towers)
        # tower layout, as VisionTransformer's arguments
        "class_token": m.cls_token is not None,
        "pre_norm": not isinstance(m.norm_pre, nn.Identity),
        # timm's final_norm means "a norm at the end", placed as fc_norm (after pooling) or norm (before)
        "final_norm": not (isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity)),
        "fc_norm": not isinstance(m.fc_norm, nn.Identity),
        "global_pool": m.global_pool,
    }


def is_timm_tower(vision_cfg: dict) -> bool:
    return bool(vision_cfg.get("timm_model_name"))
