"""Fine-tuning set-up: pretrained weights by name, image-size change, tower locking — decided before training.

``prepare(cfg)`` runs before anything is written or built: it resolves ``--pretrained`` (file, OpenCLIP
tag, ``open_clip:MODEL/TAG``, ``hf-hub:ORG/NAME``), picks the architecture and the tokenizer those
weights need (unless ``--tokenizer`` is given), applies ``--force-image-size`` to the architecture and
checks the locking flags. ``check_weights`` then checks every tensor's name and shape against the
final model (after the tokenizer fixed the vocabulary), so a wrong checkpoint fails in one line before
DeepSpeed starts. ``after_construction`` is what the engine builder runs on the constructed model:
load the weights (position embeddings resampled to the new size), then lock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dsclip.checkpoint.pretrained import WeightSource, load_pretrained_into, plan_pretrained, resolve_pretrained
from dsclip.config import ConfigError, RunConfig
from dsclip.model import get_model_config, resolve_model_config
from dsclip.model.lock import LockError, apply_locking, check_lock_config
from dsclip.train.metrics import console

# Bytes per parameter that locking saves: its gradient and Adam's two moments (fp32), plus the fp32 master
# copy when training in bf16/fp16 (then the gradient itself is 2 bytes).
SAVED_BYTES = {"fp32": 4 + 8, "bf16": 2 + 4 + 8, "fp16": 2 + 4 + 8}


@dataclass
class Finetune:
    cfg: RunConfig
    model_cfg: dict  # the architecture to build (before tokenizer-dependent text_cfg overrides)
    weights: str | None  # local weights file, or None
    counts: dict = field(default_factory=dict)  # total / trainable / locked parameters, after construction

    def check_weights(self, resolved_model_config: dict) -> None:
        """Key set and shapes of the weights against the final model, before anything is built."""
        if self.weights:
            plan_pretrained(WeightSource(self.weights), resolved_model_config, self.cfg.model.model)

    def after_construction(self, model) -> None:
        """Weights first (every tensor, locked or not), then locking (before the optimizer sees the model)."""
        if self.weights:
            load_pretrained_into(model, self.weights)
        self.counts = apply_locking(model, self.cfg.lock)

    def summary(self, precision: str, zero_stage: int, world_size: int) -> str:
        c = self.counts
        if not c:
            return ""
        text = f"trainable {c['trainable']:,} of {c['total']:,} params"
        if c["locked"]:
            saved = c["locked"] * SAVED_BYTES.get(precision, 12) / 2**20
            per_rank = saved / world_size if zero_stage >= 2 else saved
            text += f" ({c['locked']:,} locked: {per_rank:,.1f} MiB/rank of gradients + optimizer state not allocated)"
        return text


def prepare(cfg: RunConfig, *, rank: int = 0) -> Finetune:
    """The set-up for ``cfg``; ``Finetune.cfg`` is ``cfg`` with what the pretrained weights decide filled in
    (their architecture's name, their tokenizer unless ``--tokenizer``); ``cfg`` itself is not changed."""
    model_cfg, weights, quick_gelu = None, None, False
    if cfg.model.pretrained:
        r = resolve_pretrained(cfg.model.model, cfg.model.pretrained, cfg.model.cache_dir)
        weights, model_cfg, quick_gelu = r.path, r.model_cfg, r.quick_gelu
        # open_clip:MODEL/TAG, hf-hub:ORG/NAME, a folder: the weights' architecture names the run's model
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model=r.model))
        if r.tokenizer and not cfg.data.tokenizer:  # what the weights were trained with; --tokenizer overrides
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=r.tokenizer))
            if rank == 0:
                console(f"dsclip: --pretrained {cfg.model.pretrained}: tokenizer {r.tokenizer}")
    if model_cfg is None:
        model_cfg = get_model_config(cfg.model.model)
    # OpenCLIP's pretrained cfg says so (OpenAI weights), as open_clip.create_model does, or --force-quick-gelu;
    # kept in the model's config, so checkpoints and `dsclip convert` carry it
    if quick_gelu or cfg.model.force_quick_gelu:
        model_cfg["quick_gelu"] = True
    size = cfg.data.force_image_size
    if size is not None:
        if size < 1 or size % model_cfg["vision_cfg"].get("patch_size", 16):
            raise ConfigError(
                f"--force-image-size {size} must be a positive multiple of the patch size "
                f"{model_cfg['vision_cfg'].get('patch_size', 16)}"
            )
        model_cfg["vision_cfg"]["image_size"] = size
    try:
        check_lock_config(cfg.lock, resolve_model_config(model_cfg))
    except LockError as e:
        raise ConfigError(str(e)) from None
    return Finetune(cfg, model_cfg, weights)
