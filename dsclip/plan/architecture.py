"""A model's shapes and parameter counts as the planner reads them: from the architecture alone (no GPU, no
weights; the model is built on the meta device to count parameters)."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import asdict, dataclass

from dsclip.model import get_model_config, resolve_model_config
from dsclip.model.lock import LockConfig


@dataclass
class Tower:
    tokens: int  # T: sequence length seen by the blocks
    width: int  # W
    layers: int
    heads: int
    hidden: int  # H: MLP hidden width (int(W * mlp_ratio), as timm's Block)
    causal: bool = False


@dataclass
class Arch:
    name: str
    embed_dim: int
    image_size: int
    patch_size: int
    vision: Tower
    text: Tower
    vocab_size: int
    params: int = 0
    vision_params: int = 0
    text_params: int = 0
    largest_layer_params: int = 0
    trainable_params: int = 0  # after --lock-image / --lock-text
    patch_dropout: float = 0.0
    config_json: str = ""  # the resolved config (sorted JSON): what ZeRO-3's persistent parameters are counted on

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def kept_patches(patches: int, patch_dropout: float) -> int:
    """timm's PatchDropout keeps max(1, int(N * (1 - p))) patches (the class token is always kept)."""
    return patches if patch_dropout <= 0 else max(1, int(patches * (1.0 - patch_dropout)))


def load_arch(
    model: str | dict,
    patch_dropout: float = 0.0,
    count_params: bool = True,
    image_size: int | None = None,
    lock: LockConfig | None = None,
) -> Arch:
    """Shapes of a registered name / JSON path / config dict; parameters counted on the meta device.
    ``image_size``: ``--force-image-size``; ``lock``: the locking flags (trainable parameters counted)."""
    raw = copy.deepcopy(model) if isinstance(model, dict) else get_model_config(model)
    if image_size:
        raw.setdefault("vision_cfg", {})["image_size"] = int(image_size)
    cfg = resolve_model_config(raw)
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    n = (v["image_size"] // v["patch_size"]) ** 2
    vis = Tower(
        1 + kept_patches(n, patch_dropout),
        v["width"],
        v["layers"],
        v["width"] // v["head_width"],
        int(v["width"] * v["mlp_ratio"]),
    )
    txt = Tower(
        t["context_length"],
        t["width"],
        t["layers"],
        t["heads"],
        int(t["width"] * t["mlp_ratio"]),
        causal=True,
    )
    arch = Arch(
        str(model if not isinstance(model, dict) else "custom"),
        cfg["embed_dim"],
        v["image_size"],
        v["patch_size"],
        vis,
        txt,
        t["vocab_size"],
        patch_dropout=patch_dropout,
    )
    if count_params:
        lock_key = json.dumps(asdict(lock), sort_keys=True) if lock else ""
        arch.config_json = json.dumps(cfg, sort_keys=True)
        counts = _param_counts(arch.config_json, lock_key)
        arch.params, arch.trainable_params, arch.vision_params, arch.text_params, arch.largest_layer_params = counts
    return arch


@functools.lru_cache(maxsize=64)
def _param_counts(cfg_json: str, lock_json: str) -> tuple[int, int, int, int, int]:
    """(params, trainable, vision, text, largest layer) of a resolved config, built once on the meta device:
    the search (dsclip.plan.search) plans dozens of configurations of one model."""
    cfg = json.loads(cfg_json)
    lock = LockConfig(**json.loads(lock_json)) if lock_json else None
    from dsclip.model import create_model  # lazy: torch + timm, which `dsclip plan --help` must not load (#33)
    from dsclip.model.lock import apply_locking

    m = create_model(cfg, device="meta")
    params = sum(p.numel() for p in m.parameters())
    trainable = apply_locking(m, lock)["trainable"] if lock is not None else params
    vision = sum(p.numel() for p in m.visual.parameters())
    text = sum(p.numel() for p in m.text.parameters())
    # As DeepSpeed's model_to_params: the most parameters any single module owns directly.
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    return params, trainable, vision, text, largest
