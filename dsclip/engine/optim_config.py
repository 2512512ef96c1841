"""Run config section ``optim`` (OpenCLIP flag names), apart from the optimizer code in dsclip.engine.optim.

Why a module of its own: ``dsclip train --help`` and the checks before the process group build the run
config, and must not import torch (dsclip.engine.optim subclasses torch's AdamW at import). timm is
imported only when ``--opt timm/NAME`` is checked.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from dsclip.config_base import ConfigError, opt


@dataclass
class OptimArgs:
    """Run config section ``optim``: AdamW and the learning-rate schedule (OpenCLIP flag names)."""

    lr: float = opt(5.0e-4, "Peak learning rate.")
    wd: float = opt(0.2, "Weight decay (not applied to biases, norms, embeddings, logit_scale/bias).")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.98, "Adam beta2.")
    eps: float = opt(1.0e-6, "Adam epsilon.")
    warmup: int = opt(10000, "Linear warm-up length in optimizer steps.")
    lr_scheduler: str = opt(
        "cosine", "Learning-rate schedule after warm-up.", choices=("cosine", "const", "const-cooldown")
    )
    epochs_cooldown: float | None = opt(None, "const-cooldown: length of the final cool-down, in epochs.")
    lr_cooldown_power: float = opt(1.0, "const-cooldown: power of the polynomial cool-down.")
    lr_cooldown_end: float = opt(0.0, "const-cooldown: learning rate at the end of the cool-down.")
    grad_clip_norm: float | None = opt(None, "Clip the global gradient norm to this value.")
    skip_scheduler: bool = opt(
        False, "Keep the learning rate at --lr throughout: no warm-up, no schedule (OpenCLIP's)."
    )
    momentum: float | None = opt(
        None,
        "Momentum for an optimizer that takes one (the DeepSpeed JSON's optimizer block: SGD, MuSGD); "
        "AdamW's is --beta1.",
    )
    # OpenCLIP main (src/open_clip_train/params.py): "--image-layer-decay", "--visual-layer-decay" (one option,
    # dest image_layer_decay) and "--text-layer-decay"; lr(group) = lr * decay**(depth_from_head).
    image_layer_decay: float | None = opt(
        None,
        "Layer-wise lr decay of the image tower (OpenCLIP main's flag): a layer group d groups below the "
        "projection trains at lr * DECAY**d; the projection keeps --lr. Off when unset or 1.0; in (0, 1].",
        aliases=("--visual-layer-decay",),
    )
    text_layer_decay: float | None = opt(
        None,
        "Layer-wise lr decay of the text tower (OpenCLIP main's flag): lr * DECAY**(groups below "
        "text_projection). Off when unset or 1.0; in (0, 1].",
    )
    # Last: the name shadows the `opt` helper for any field defined after it in this class body.
    opt: str = opt(
        "adamw",
        "Optimizer (OpenCLIP's flag): adamw, or timm/NAME for any timm optimizer (timm/lion, timm/lamb, "
        "timm/sgd, ...), built by timm.optim.create_optimizer_v2 over the same weight-decay groups. Not with a "
        "DeepSpeed JSON optimizer block, nor with ZeRO-Offload.",
    )

    def __post_init__(self):
        self.opt = self.opt.lower()  # OpenCLIP lower-cases it too (AdamW == adamw)

    def check(self) -> None:
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ConfigError(f"'lr' must be a positive number, got {self.lr}")
        if self.warmup < 0:
            raise ConfigError(f"'warmup' must be >= 0, got {self.warmup}")
        if self.opt != "adamw":
            timm_optimizer_info(self.opt)  # an unknown name fails here, before any work
        for flag, decay in (
            ("--image-layer-decay", self.image_layer_decay),
            ("--text-layer-decay", self.text_layer_decay),
        ):
            if decay is not None and not (0.0 < decay <= 1.0):  # outside: negative or growing lrs below the head
                raise ConfigError(f"{flag} {decay:g} is outside (0, 1]: use e.g. 0.65, or 1.0 for no decay")
        if self.lr_scheduler == "const-cooldown" and self.epochs_cooldown is None:
            raise ConfigError("--lr-scheduler const-cooldown needs --epochs-cooldown")


def timm_optimizer_info(name: str):
    """timm's OptimInfo for ``--opt timm/NAME`` (OpenCLIP's spelling); ConfigError for anything else."""
    if not name.lower().startswith("timm/"):
        raise ConfigError(f"--opt {name}: use adamw or timm/NAME (a timm optimizer, e.g. timm/lion), as OpenCLIP")
    from timm.optim import list_optimizers
    from timm.optim._optim_factory import get_optimizer_info

    base = name.split("/", 1)[1].lower()
    try:
        return get_optimizer_info(base.split("_")[-1])  # timm's own parsing: lookahead_NAME wraps NAME
    except ValueError:
        close = difflib.get_close_matches(base, list_optimizers(), n=1)
        hint = f" (did you mean timm/{close[0]}?)" if close else ""
        raise ConfigError(
            f"--opt {name}: timm has no optimizer '{base}'{hint}; see timm.optim.list_optimizers()"
        ) from None
