"""State-dict conversion between dsclip and OpenCLIP's native ViT ``CLIP`` layout (declarative key map).

Every tensor is covered by exactly one rule in ``KEY_MAP`` (dsclip pattern, OpenCLIP pattern, reshape);
``{i}`` is a block index and ``{p}`` is ``weight`` or ``bias``. The converted dict is then checked key by
key and shape by shape against the model the config builds; any difference raises
``StateDictMismatchError`` naming every missing, unexpected and mismatched key (no ``strict=False``).

OpenCLIP files: ``open_clip_config.json`` = ``{"model_cfg": ..., "preprocess_cfg": ...}`` (see
``openclip_model_config``) next to ``open_clip_model.safetensors`` is what
``open_clip.create_model_and_transforms("local-dir:/that/dir")`` loads; ``export_openclip`` writes both.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import DROPOUT_DEFAULTS, resolve_model_config
from .factory import create_model

# OpenCLIP / OpenAI normalisation constants (open_clip.constants)
OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)

Reshape = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
SAME: Reshape = (lambda v: v, lambda v: v)
CLS: Reshape = (lambda v: v.reshape(-1), lambda v: v.reshape(1, 1, -1))  # (1, 1, W) <-> (W,)
POS: Reshape = (lambda v: v.squeeze(0), lambda v: v.unsqueeze(0))  # (1, T, W) <-> (T, W)
SCALAR: Reshape = (lambda v: v.reshape(()), lambda v: v.reshape(1))  # (1,) <-> () (DeepSpeed needs 1-D)

# timm Block <-> OpenCLIP ResidualAttentionBlock (fused qkv == nn.MultiheadAttention in_proj: q, k, v rows)
BLOCK_MAP: list[tuple[str, str]] = [
    ("norm1.{p}", "ln_1.{p}"),
    ("attn.qkv.weight", "attn.in_proj_weight"),
    ("attn.qkv.bias", "attn.in_proj_bias"),
    ("attn.proj.{p}", "attn.out_proj.{p}"),
    ("ls1.gamma", "ls_1.gamma"),
    ("norm2.{p}", "ln_2.{p}"),
    ("mlp.fc1.{p}", "mlp.c_fc.{p}"),
    ("mlp.fc2.{p}", "mlp.c_proj.{p}"),
    ("ls2.gamma", "ls_2.gamma"),
]

TRANSPOSE: Reshape = (lambda v: v.t(), lambda v: v.t())  # (width, embed) parameter <-> nn.Linear weight

# OpenCLIP's own ViT (``visual.*``) and text transformer (``CLIP``: at the top level).
KEY_MAP: list[tuple[str, str, Reshape]] = [
    ("visual.patch_embed.proj.weight", "visual.conv1.weight", SAME),
    ("visual.cls_token", "visual.class_embedding", CLS),
    ("visual.pos_embed", "visual.positional_embedding", POS),
    ("visual.norm_pre.{p}", "visual.ln_pre.{p}", SAME),
    *[(f"visual.blocks.{{i}}.{d}", f"visual.transformer.resblocks.{{i}}.{o}", SAME) for d, o in BLOCK_MAP],
    ("visual.norm.{p}", "visual.ln_post.{p}", SAME),
    ("visual.proj", "visual.proj", SAME),
    ("text.token_embedding.weight", "token_embedding.weight", SAME),
    ("text.positional_embedding", "positional_embedding", SAME),
    *[(f"text.blocks.{{i}}.{d}", f"transformer.resblocks.{{i}}.{o}", SAME) for d, o in BLOCK_MAP],
    ("text.ln_final.{p}", "ln_final.{p}", SAME),
    ("text.text_projection", "text_projection", SAME),
    ("logit_scale", "logit_scale", SCALAR),
    ("logit_bias", "logit_bias", SCALAR),
]

# A timm image tower (OpenCLIP's TimmModel: timm's names under visual.trunk, projection in visual.head).
TIMM_VISION_MAP: list[tuple[str, str, Reshape]] = [
    ("visual.proj", "visual.head.proj.weight", TRANSPOSE),  # timm_proj 'linear' (bias-free)
    ("visual.{rest}", "visual.trunk.{rest}", SAME),
]

_GROUPS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)", "rest": r"(?P<rest>.+)"}


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in _GROUPS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), group)
    return re.compile(pattern)


def key_map(model_config: dict | None = None) -> list[tuple[str, str, Reshape]]:
    """The rules for this architecture (None: OpenCLIP's ViT + ``CLIP`` text layout). A timm image
    tower maps ``visual.X`` to ``visual.trunk.X``; ``custom_text`` (OpenCLIP's ``CustomTextCLIP``) keeps
    the text tower under ``text.``; a text projection with bias (SigLIP) is an nn.Linear's weight and bias."""
    if model_config is None:
        return KEY_MAP
    cfg = resolve_model_config(model_config)
    vision = [r for r in KEY_MAP if r[0].startswith("visual.")]
    if cfg["vision_cfg"].get("timm_model_name"):
        vision = TIMM_VISION_MAP
    prefix = "text." if cfg.get("custom_text") else ""
    text = [(d, prefix + o, r) for d, o, r in KEY_MAP if d.startswith("text.") and d != "text.text_projection"]
    if cfg["text_cfg"]["proj_bias"]:
        text.append(("text.text_projection.{p}", prefix + "text_projection.{p}", SAME))
    else:
        text.append(("text.text_projection", prefix + "text_projection", SAME))
    return [*vision, *text, *(r for r in KEY_MAP if r[0].startswith("logit_"))]


def _rules(model_config: dict | None, to_openclip: bool):
    if to_openclip:
        return [(_compile(d), o, reshape[0]) for d, o, reshape in key_map(model_config)]
    return [(_compile(o), d, reshape[1]) for d, o, reshape in key_map(model_config)]


class StateDictMismatchError(ValueError):
    """A state dict whose keys or shapes don't match the model; the message lists every difference."""


def _convert(sd: Mapping[str, torch.Tensor], rules, direction: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    unmapped = []
    for key, value in sd.items():
        for pattern, target, reshape in rules:
            m = pattern.fullmatch(key)
            if m:
                out[target.format(**m.groupdict())] = reshape(value)
                break
        else:
            unmapped.append(key)
    if unmapped:
        raise StateDictMismatchError(
            f"{direction}: {len(unmapped)} key(s) have no rule in dsclip.model.openclip.KEY_MAP: "
            + ", ".join(sorted(unmapped))
        )
    return out


def check_state_dict(
    sd: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size | tuple], what: str = "state dict"
) -> None:
    """Raise ``StateDictMismatchError`` unless ``sd`` has exactly the expected keys and shapes."""
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    mismatched = sorted(
        f"{k}: got {tuple(sd[k].shape)}, expected {tuple(expected[k])}"
        for k in set(sd) & set(expected)
        if tuple(sd[k].shape) != tuple(expected[k])
    )
    if missing or unexpected or mismatched:
        lines = [f"{what} does not match the model:"]
        for title, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape mismatch", mismatched),
        ):
            if items:
                lines.append(f"  {title} ({len(items)}): " + ", ".join(items))
        raise StateDictMismatchError("\n".join(lines))


def unwrap_state_dict(obj) -> dict[str, torch.Tensor]:
    """Accept ``{"state_dict": sd}`` / ``{"model": sd}`` wrappers and strip DDP ``module.`` prefixes."""
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    elif isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a state dict (mapping of tensors), got {type(obj).__name__}")
    return {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in obj.items()}


def load_openclip_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read an OpenCLIP checkpoint (``.safetensors``, or ``.pt``/``.pth``/``.bin`` via ``torch.load``
    with ``weights_only=True``) into a plain state dict (wrappers and ``module.`` prefixes removed)."""
    path = str(path)
    if path.endswith(".safetensors"):
        return unwrap_state_dict(load_file(path, device="cpu"))
    return unwrap_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def expected_shapes(model_config: dict) -> dict[str, torch.Size]:
    """dsclip parameter names -> shapes for a config (built on the meta device: no memory, no init)."""

    return {k: v.shape for k, v in create_model(model_config, device="meta").state_dict().items()}


def _openclip_expected(model_config: dict) -> dict[str, torch.Size]:
    meta = {k: torch.empty(shape, device="meta") for k, shape in expected_shapes(model_config).items()}
    return {k: v.shape for k, v in _convert(meta, _rules(model_config, True), "dsclip -> OpenCLIP").items()}


def to_openclip_state_dict(sd: Mapping[str, torch.Tensor], model_config: dict | None = None) -> dict[str, torch.Tensor]:
    """dsclip state dict -> OpenCLIP native keys/shapes (``logit_scale``/``logit_bias`` 0-dim).

    With ``model_config`` the input is first checked against the model that config builds; without one,
    OpenCLIP's ViT + ``CLIP`` layout is assumed (a timm tower or custom text needs the config)."""
    sd = unwrap_state_dict(sd)
    if model_config is not None:
        check_state_dict(sd, expected_shapes(model_config), "dsclip state dict")
    return _convert(sd, _rules(model_config, True), "dsclip -> OpenCLIP")


def to_openclip_tensor(name: str, value: torch.Tensor, model_config: dict | None) -> tuple[str, torch.Tensor]:
    """One dsclip tensor -> (its OpenCLIP name, the tensor in OpenCLIP's shape); a meta tensor stays meta."""
    ((oc_name, oc_value),) = _convert({name: value}, _rules(model_config, True), "dsclip -> OpenCLIP").items()
    return oc_name, oc_value


def to_openclip_name(name: str, shape: torch.Size | tuple, model_config: dict | None) -> tuple[str, torch.Size]:
    """One dsclip tensor's OpenCLIP name and shape (nothing is materialised)."""
    oc_name, oc_meta = to_openclip_tensor(name, torch.empty(shape, device="meta"), model_config)
    return oc_name, oc_meta.shape


def from_openclip_state_dict(sd: Mapping[str, torch.Tensor], model_config: dict) -> dict[str, torch.Tensor]:
    """OpenCLIP native state dict (optionally wrapped / ``module.``-prefixed) -> dsclip state dict that
    ``create_model(model_config).load_state_dict(out, strict=True)`` accepts. Checked against the
    OpenCLIP layout first, so errors name OpenCLIP's keys."""
    sd = unwrap_state_dict(sd)
    for key in ("logit_scale", "logit_bias"):  # OpenCLIP's nonscalar_logit_scale variant stores (1,)
        if key in sd and sd[key].numel() == 1:
            sd[key] = sd[key].reshape(())
    if resolve_model_config(model_config).get("custom_text") and "token_embedding.weight" in sd:
        sd = _to_custom_text(sd)
    check_state_dict(sd, _openclip_expected(model_config), "OpenCLIP state dict")
    return _convert(sd, _rules(model_config, False), "OpenCLIP -> dsclip")


_CLIP_TEXT_KEYS = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")


def _to_custom_text(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # OpenCLIP's convert_to_custom_text_state_dict: a CLIP-layout text tower loads into CustomTextCLIP
    return {("text." + k if k.startswith(_CLIP_TEXT_KEYS) else k): v for k, v in sd.items()}


def is_openclip_state_dict(sd: Mapping[str, torch.Tensor]) -> bool:
    if "visual.conv1.weight" in sd or "visual.class_embedding" in sd:
        return True
    return any(k.startswith("visual.trunk.") for k in sd)  # a timm image tower (OpenCLIP's TimmModel)


def openclip_model_config(model_config: dict, preprocess_cfg: dict | None = None) -> dict:
    """``open_clip_config.json`` content: ``{"model_cfg": <resolved config>, "preprocess_cfg": {...}}``.
    ``preprocess_cfg`` entries override the defaults (OpenAI mean/std, bicubic, config image size)."""
    cfg = resolve_model_config(model_config)
    for section in ("vision_cfg", "text_cfg"):  # dsclip-only regularisation keys: OpenCLIP's cfg rejects them
        for key in DROPOUT_DEFAULTS:
            cfg[section].pop(key, None)
    pre = {
        "size": cfg["vision_cfg"]["image_size"],
        "mode": "RGB",
        "mean": list(OPENAI_DATASET_MEAN),
        "std": list(OPENAI_DATASET_STD),
        "interpolation": "bicubic",
        "resize_mode": "shortest",
        "fill_color": 0,
    }
    pre.update(preprocess_cfg or {})
    return {"model_cfg": cfg, "preprocess_cfg": pre}


def export_openclip(
    state_dict: Mapping[str, torch.Tensor],
    model_config: dict,
    out_dir: str | os.PathLike,
    preprocess_cfg: dict | None = None,
) -> Path:
    """Write ``open_clip_config.json`` + ``open_clip_model.safetensors`` (OpenCLIP's local-dir format:
    ``open_clip.create_model_and_transforms("local-dir:" + out_dir)``). Returns the weights path."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    oc = to_openclip_state_dict(state_dict, model_config)
    weights = out / "open_clip_model.safetensors"
    save_file({k: v.detach().contiguous().cpu() for k, v in oc.items()}, str(weights))
    with open(out / "open_clip_config.json", "w") as f:
        json.dump(openclip_model_config(model_config, preprocess_cfg), f, indent=2)
    return weights
