"""LiT and partial tower locking with OpenCLIP's flags and meaning (``--lock-image``, ``--lock-text``, ...).

Locking sets ``requires_grad = False``; ``dsclip.engine.optim.param_groups`` leaves such parameters
out of the optimizer's groups, so DeepSpeed (ZeRO-1/2/3) allocates no gradient partition, no fp32
master copy and no Adam state for them. The weights themselves stay in the model: checkpoints,
resume and ``dsclip convert`` still hold every tensor.

Groups, as OpenCLIP's ``VisionTransformer.lock`` / ``lock_text_tower`` define them (``N`` unlocked
groups = the last ``N`` of these stay trainable):

- image: [patch embedding + class token + positions + ln_pre], block 0, ..., block L-2,
  [block L-1 + final norm], [proj]                                  (layers + 2 groups)
  A timm image tower (SigLIP) the same way: [patch embedding + positions], blocks, [block L-1 + norm +
  attention pool], and [proj] only where it has one (``timm_proj`` 'none': layers + 1 groups).
- text:  [token + positional embedding], block 0, ..., block L-2,
  [block L-1 + ln_final], [text_projection]                          (layers + 2 groups)

``logit_scale`` / ``logit_bias`` are never locked (as in OpenCLIP). ``--lock-image-freeze-bn-stats``
is accepted for compatibility: a ViT has no BatchNorm, so (as in OpenCLIP's ViT) it changes nothing.
``--lock-text-freeze-layer-norm`` has the meaning of OpenCLIP's Hugging Face text towers: without it
the LayerNorm parameters of locked text layers stay trainable; with it they are locked too.
(OpenCLIP's native text tower refuses to run without the flag; dsclip gives it a meaning instead.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsclip.config_base import ConfigError

if TYPE_CHECKING:  # LockConfig is a run-config section: the config parser must not load torch (issue #33)
    from torch import nn


class LockError(ConfigError):
    """A locking request that cannot be honoured (printed as one line by the CLI)."""


@dataclass
class LockConfig:
    lock_image: bool = field(
        default=False, metadata={"help": "Lock the image tower (LiT): no gradients, no optimizer state."}
    )
    lock_image_unlocked_groups: int = field(
        default=0,
        metadata={
            "help": "With --lock-image: leave the last N image-tower groups trainable (groups: embeddings, "
            "each block, last block + final norm, projection)."
        },
    )
    lock_image_freeze_bn_stats: bool = field(
        default=False, metadata={"help": "OpenCLIP compatibility: freeze BatchNorm stats (a ViT has none)."}
    )
    lock_text: bool = field(default=False, metadata={"help": "Lock the text tower: no gradients, no optimizer state."})
    lock_text_unlocked_layers: int = field(
        default=0,
        metadata={
            "help": "With --lock-text: leave the last N text-tower groups trainable (groups: embeddings, each "
            "block, last block + ln_final, projection)."
        },
    )
    lock_text_freeze_layer_norm: bool = field(
        default=False,
        metadata={"help": "With --lock-text: also lock the LayerNorms of locked layers (else they stay trainable)."},
    )

    def check(self) -> None:
        """What needs no architecture; group ranges are checked against the model in check_lock_config."""
        if self.lock_image_unlocked_groups and not self.lock_image:
            raise LockError("--lock-image-unlocked-groups needs --lock-image")
        if self.lock_text_unlocked_layers and not self.lock_text:
            raise LockError("--lock-text-unlocked-layers needs --lock-text")


def image_groups(model: nn.Module) -> list[list]:
    v = model.visual
    blocks = list(v.blocks)
    # a timm tower (SigLIP) has no class token / pre-norm, pools with attn_pool, and may have no projection
    head = [x for x in (blocks[-1], v.norm, v.attn_pool, v.fc_norm) if x is not None]
    groups = [[x for x in (v.patch_embed, v.cls_token, v.pos_embed, v.norm_pre) if x is not None]]
    groups += [[b] for b in blocks[:-1]] + [head]
    return groups + ([[v.proj]] if v.proj is not None else [])


def image_group_count(model_config: dict) -> int:
    """len(image_groups(model)) from the config alone: stem, blocks, head (+ the projection, if any)."""
    vision = model_config["vision_cfg"]
    no_proj = vision.get("timm_model_name") and vision.get("timm_proj") == "none"
    return vision["layers"] + (1 if no_proj else 2)


def text_groups(model: nn.Module) -> list[list]:
    t = model.text
    blocks = list(t.blocks)
    return [
        [t.token_embedding, t.positional_embedding],
        *[[b] for b in blocks[:-1]],
        [blocks[-1], t.ln_final],
        [t.text_projection],
    ]


def _params(items) -> list[nn.Parameter]:
    from torch import nn

    out = []
    for x in items:
        if isinstance(x, nn.Parameter):
            out.append(x)
        else:
            out.extend(x.parameters())
    return out


def _lock_tower(groups: list[list], unlocked: int) -> None:
    """Lock all but the last ``unlocked`` groups (range checked by check_lock_config)."""
    for p in _params([x for g in groups[: len(groups) - unlocked] for x in g]):
        p.requires_grad_(False)


def check_lock_config(cfg: LockConfig, model_config: dict) -> None:
    """The checks that need only the architecture (before anything is built): group ranges, and that
    something is left to train."""
    n_img = image_group_count(model_config)
    n_txt = model_config["text_cfg"]["layers"] + 2
    if cfg.lock_image_unlocked_groups and not cfg.lock_image:
        raise LockError("--lock-image-unlocked-groups needs --lock-image")
    if cfg.lock_text_unlocked_layers and not cfg.lock_text:
        raise LockError("--lock-text-unlocked-layers needs --lock-text")
    for value, n, what, flag in (
        (cfg.lock_image_unlocked_groups, n_img, "image", "--lock-image-unlocked-groups"),
        (cfg.lock_text_unlocked_layers, n_txt, "text", "--lock-text-unlocked-layers"),
    ):
        if value < 0 or value > n:
            raise LockError(
                f"{flag} {value} is out of range: the {what} tower has {n} groups "
                f"(use 0..{n}; {n} unlocks the whole tower)"
            )
    if (
        cfg.lock_image
        and cfg.lock_text
        and cfg.lock_image_unlocked_groups == 0
        and cfg.lock_text_unlocked_layers == 0
        and cfg.lock_text_freeze_layer_norm
    ):
        raise LockError(
            "--lock-image and --lock-text lock both towers entirely: nothing is left to train but the "
            "temperature; unlock groups with --lock-image-unlocked-groups / --lock-text-unlocked-layers"
        )


def apply_locking(model: nn.Module, cfg: LockConfig) -> dict[str, int]:
    """Lock ``model`` (a dsclip ``CLIP``) per ``cfg``, in place; returns parameter counts
    ``{"total", "trainable", "locked"}``. Works on ZeRO-3 partitioned parameters (``ds_numel``)."""
    from torch import nn

    check_lock_config(cfg, model.config)
    if cfg.lock_image:
        _lock_tower(image_groups(model), cfg.lock_image_unlocked_groups)
    if cfg.lock_text:
        _lock_tower(text_groups(model), cfg.lock_text_unlocked_layers)
        if not cfg.lock_text_freeze_layer_norm:  # OpenCLIP's HF towers: LayerNorms of locked layers still train
            for m in model.text.modules():
                if isinstance(m, nn.LayerNorm):
                    for p in m.parameters():
                        p.requires_grad_(True)
    return count_parameters(model)


def numel(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3: p is a flat (possibly empty) shard


def count_parameters(model: nn.Module) -> dict[str, int]:
    total = sum(numel(p) for p in model.parameters())
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "locked": total - trainable}
