"""Which contrastive loss a run uses: the run config's ``loss`` section and what ``build_loss`` builds.

Two views of one concept, defined together so there is one list of names, one set of defaults and
one set of checks:

* :class:`LossArgs` is the run config section, in OpenCLIP's flag spelling (``--siglip``,
  ``--local-loss --gather-with-grad``, plus dsclip's ``--tiled-loss``); ``LossArgs.name`` maps the
  flags to a loss name, and :data:`LOSS_FLAGS` maps a name back to its flags (``dsclip plan``).
* :class:`LossConfig` is the resolved selection (name, tile size, label smoothing) that
  :func:`dsclip.losses.build_loss` takes; its checks are the only checks of those values.

No torch here: ``dsclip plan`` and the config loader read it without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsclip.config_base import ConfigError, opt

LOSS_NAMES = ("infonce", "infonce_local", "infonce_tiled", "siglip")
LOSS_FLAGS = {  # name -> the dsclip train flags that select it
    "infonce": [],
    "infonce_local": ["--local-loss", "--gather-with-grad"],
    "infonce_tiled": ["--tiled-loss"],
    "siglip": ["--siglip"],
}
# open_clip.loss.SigLipLoss's dist_impl values: four ways to move the text blocks between ranks
SIGLIP_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
DISTILL_LOSSES = ("infonce", "infonce_local")  # the ones that build the logit rows distillation compares
TRAIN_TILE_SIZE = 4096  # --loss-tile-size default (large tiles: fewer ring steps per GPU step)


@dataclass
class LossConfig:
    """A loss selection, as :func:`dsclip.losses.build_loss` takes it."""

    name: str = "infonce"
    """One of: infonce (global N x N on every rank), infonce_local (OpenCLIP --local-loss
    --gather-with-grad, b x N per rank), infonce_tiled (memory-bounded ring InfoNCE, same value as
    infonce), siglip (sigmoid loss with logit_bias, tiled ring)."""
    tile_size: int = TRAIN_TILE_SIZE
    """Rows/columns per tile for infonce_tiled and siglip (need not divide the batch)."""
    label_smoothing: float = 0.0
    """InfoNCE label smoothing (as torch cross_entropy's label_smoothing); not for siglip."""
    check_finite: bool = True
    """Raise LossInputError on every rank if any rank's features/scale/bias hold NaN or Inf."""
    distill: bool = False
    """Add OpenCLIP's distillation term on a frozen teacher's logits (infonce / infonce_local only)."""

    def __post_init__(self):
        if self.name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.name!r}; choose one of {', '.join(LOSS_NAMES)}")
        if int(self.tile_size) < 1:
            raise ValueError(f"tile_size (--loss-tile-size) must be >= 1, got {self.tile_size}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing (--label-smoothing) must be in [0, 1), got {self.label_smoothing}")
        if self.name == "siglip" and self.label_smoothing:
            raise ValueError("label_smoothing (--label-smoothing) applies to the InfoNCE losses, not siglip")
        if self.distill and self.name not in DISTILL_LOSSES:
            raise ValueError(
                f"distillation (--distill-model) works with the InfoNCE losses {' and '.join(DISTILL_LOSSES)}, "
                f"not {self.name}: OpenCLIP's DistillClipLoss compares full logit rows, which {self.name} never builds"
            )


@dataclass
class LossArgs:
    """Run config section ``loss`` (flag names as in OpenCLIP)."""

    siglip: bool = opt(False, "Use the sigmoid (SigLIP) loss with a learnable logit_bias.")
    local_loss: bool = opt(
        False, "InfoNCE over this rank's rows against all columns (OpenCLIP --local-loss); needs --gather-with-grad."
    )
    gather_with_grad: bool = opt(
        False,
        "Gather features with gradient (OpenCLIP --gather-with-grad). dsclip always gathers with "
        "gradient because anything else gives wrong gradients; the flag is accepted for compatibility.",
    )
    tiled_loss: bool = opt(
        False, "Memory-bounded InfoNCE: tiled online log-sum-exp over a ring of ranks; never builds the logit matrix."
    )
    loss_tile_size: int = opt(TRAIN_TILE_SIZE, "Tile edge of the tiled loss (rows/columns per tile).")
    label_smoothing: float = opt(0.0, "Label smoothing of the InfoNCE cross-entropies.")
    loss_dist_impl: str | None = opt(
        None,
        "OpenCLIP's SigLIP exchange (bidir, shift, reduce, gather; needs --siglip). All four compute the same "
        "loss and gradients, and so does dsclip's one exchange, the tiled ring, which every value runs.",
        choices=SIGLIP_DIST_IMPLS,
    )
    distill_model: str | None = opt(
        None,
        "Architecture of a frozen teacher CLIP to distill from (OpenCLIP's): loss = InfoNCE + cross-entropy of "
        "the student's logits against the teacher's softmax. Needs --distill-pretrained.",
    )
    distill_pretrained: str | None = opt(
        None,
        "The teacher's weights: a file, an export folder, an OpenCLIP tag of --distill-model, open_clip:MODEL/TAG "
        "or hf-hub:ORG/NAME (as --pretrained). The teacher reads the run's tokens and images.",
    )

    @property
    def distill(self) -> bool:
        return self.distill_model is not None

    @property
    def name(self) -> str:
        if self.siglip:
            return "siglip"
        if self.tiled_loss:
            return "infonce_tiled"
        if self.local_loss:
            return "infonce_local"
        return "infonce"

    def check(self) -> None:
        if self.local_loss and not self.gather_with_grad:
            raise ConfigError(
                "--local-loss without --gather-with-grad computes wrong gradients (each rank would only see its own "
                "rows' contribution); add --gather-with-grad"
            )
        if self.loss_dist_impl is not None and not self.siglip:
            raise ConfigError(
                f"--loss-dist-impl {self.loss_dist_impl} chooses the SigLIP exchange; add --siglip or drop it"
            )
        if self.siglip and (self.tiled_loss or self.local_loss):
            raise ConfigError("--siglip already uses a memory-bounded ring loss; drop --tiled-loss/--local-loss")
        if (self.distill_model is None) != (self.distill_pretrained is None):
            given, missing = (
                ("--distill-model", "--distill-pretrained")
                if self.distill_model is not None
                else ("--distill-pretrained", "--distill-model")
            )
            raise ConfigError(
                f"{given} without {missing}: distillation needs both the teacher's architecture and its weights "
                "(OpenCLIP would silently train without a teacher)"
            )
        if self.distill and self.siglip:
            raise ConfigError(
                "--distill-model with --siglip: OpenCLIP's distillation loss is InfoNCE (DistillClipLoss); "
                "drop --siglip"
            )
        if self.distill and self.tiled_loss:
            raise ConfigError(
                "--distill-model with --tiled-loss: the tiled loss never builds the logit rows the distillation "
                "term compares; drop --tiled-loss (or use --local-loss --gather-with-grad for b x N logits per rank)"
            )
        try:  # the values themselves: LossConfig's checks are the only ones
            self.loss_config()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def loss_config(self) -> LossConfig:
        return LossConfig(
            name=self.name, tile_size=self.loss_tile_size, label_smoothing=self.label_smoothing, distill=self.distill
        )
