"""Model-config schema: OpenCLIP's JSON layout, validated and resolved to explicit values.

A model config is the dict OpenCLIP keeps in ``open_clip/model_configs/*.json``::

    {"embed_dim": 512,
     "quick_gelu": false,                       # optional
     "init_logit_bias": -10,                    # optional (SigLIP); also selects logit_scale init ln(10)
     "vision_cfg": {"image_size", "patch_size", "width", "layers", "head_width", "mlp_ratio", ...},
     "text_cfg": {"context_length", "vocab_size", "width", "heads", "layers", "pool_type", ...}}

``resolve_model_config`` fills every default OpenCLIP would use (so ``CLIP.config`` states each number
once, explicitly) and rejects OpenCLIP options this ViT/text-transformer implementation does not build
(timm / HF towers, attentional pooling, ...): an unsupported option is an error, never silently ignored.
"""

from __future__ import annotations

import copy
import math
from typing import Any

# Defaults are OpenCLIP's (open_clip/model.py: CLIPVisionCfg, CLIPTextCfg), restricted to what we build.
VISION_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "patch_size": 16,
    "width": 768,
    "layers": 12,
    "head_width": 64,
    "mlp_ratio": 4.0,
    "patch_dropout": 0.0,
    "ls_init_value": None,
}
# dsclip extensions (regularisation only: they change no weight, so OpenCLIP exports drop them).
DROPOUT_DEFAULTS: dict[str, Any] = {"dropout": 0.0, "attn_dropout": 0.0, "drop_path_rate": 0.0}
VISION_DEFAULTS.update(DROPOUT_DEFAULTS)
TEXT_DEFAULTS: dict[str, Any] = {
    "context_length": 77,
    "vocab_size": 49408,
    "width": 512,
    "heads": 8,
    "layers": 12,
    "mlp_ratio": 4.0,
    "ls_init_value": None,
    "pool_type": "argmax",
    "eos_id": 2,
    "pad_id": 0,
    "no_causal_mask": False,  # SigLIP: bidirectional attention (with pool_type 'last')
    "proj_bias": False,  # SigLIP: text_projection is an nn.Linear with bias
    "act_kwargs": None,  # SigLIP 2: {"approximate": "tanh"}
    **DROPOUT_DEFAULTS,
}
TEXT_ACT_KWARGS = ({"approximate": "tanh"}, {"approximate": "none"})
# OpenCLIP options accepted only at their default value (anything else builds a different network).
VISION_FIXED: dict[str, Any] = {
    "attentional_pool": False,
    "no_ln_pre": False,
    "pos_embed_type": "learnable",
    "final_ln_after_pool": False,
    "pool_type": "tok",
    "output_tokens": False,
    "timm_model_name": None,
    "block_type": None,
    "qk_norm": False,
    "scaled_cosine_attn": False,
    "scale_heads": False,
    "scale_attn_inner": False,
    "scale_attn": False,
    "scale_fc": False,
    "act_kwargs": None,
    "attn_pooler_queries": 256,
    "attn_pooler_heads": 8,
    "timm_model_pretrained": False,
    "timm_pool": "avg",
    "timm_proj": "linear",
    "timm_proj_bias": False,
    "timm_drop": 0.0,
    "timm_drop_path": None,
}
TEXT_FIXED: dict[str, Any] = {
    "embed_cls": False,
    "final_ln_after_pool": False,
    "proj_type": "linear",
    "output_tokens": False,
    "hf_model_name": None,
    "block_type": None,
    "qk_norm": False,
    "scaled_cosine_attn": False,
    "scale_heads": False,
    "scale_attn_inner": False,
    "scale_attn": False,
    "scale_fc": False,
    "hf_model_pretrained": True,
    "hf_proj_type": "mlp",
    "hf_pooler_type": "mean_pooler",
}
# Tokenizer metadata OpenCLIP keeps in text_cfg; carried through untouched, not used by the network.
TEXT_PASSTHROUGH = {"hf_tokenizer_name", "tokenizer_mode", "tokenizer_kwargs"}
# custom_text: OpenCLIP's CustomTextCLIP, the same text transformer under ``text.`` in the state dict
TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale", "init_logit_bias", "custom_text"}
TOP_FIXED: dict[str, Any] = {"cast_dtype": None}
# OpenCLIP TimmModel keys of a timm image tower (dsclip.model.timm_vit): its numbers come from timm
TIMM_VISION_KEYS = {"timm_model_name", "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias",
                    "timm_drop", "timm_drop_path"}  # fmt: skip
TEXT_POOL_TYPES = ("argmax", "eos", "last", "first")


def _check_section(name: str, cfg: dict, defaults: dict, fixed: dict, passthrough=frozenset()) -> dict:
    out = dict(defaults)
    bad = []
    for k, v in cfg.items():
        if k in defaults or k in passthrough:
            out[k] = v
        elif k == "norm_kwargs":
            if v and set(v) - {"eps"}:
                bad.append(f"{name}.norm_kwargs={v} (only 'eps' is supported)")
            elif v:
                out[k] = dict(v)
        elif k in fixed:
            if v != fixed[k] and not (fixed[k] is None and not v):
                bad.append(f"{name}.{k}={v!r} (only {fixed[k]!r} is supported)")
        else:
            bad.append(f"{name}.{k} (unknown key)")
    if bad:
        raise ValueError("unsupported model-config options: " + "; ".join(bad))
    return out


def _resolve_timm_vision(cfg: dict) -> tuple[dict, list[str]]:
    """A timm image tower's vision_cfg with its numbers measured from the installed timm (see
    dsclip.model.timm_vit), and what of it dsclip cannot build (empty: it builds)."""
    from .timm_vit import TIMM_PROJS, timm_vit_spec

    name, pool, proj = cfg["timm_model_name"], cfg.get("timm_pool", "avg"), cfg.get("timm_proj", "linear")
    bad = []
    try:
        spec = timm_vit_spec(name, pool, proj)
    except ValueError as e:
        return {}, [str(e)]
    if cfg.get("timm_model_pretrained"):
        bad.append("vision_cfg.timm_model_pretrained=True (timm's own weights: give OpenCLIP's with --pretrained)")
    if proj not in TIMM_PROJS:
        bad.append(f"vision_cfg.timm_proj={proj!r} (dsclip builds {TIMM_PROJS})")
    for key in ("timm_proj_bias", "timm_drop", "ls_init_value"):
        if cfg.get(key):
            bad.append(f"vision_cfg.{key}={cfg[key]!r} (only off is supported for a timm tower)")
    measured = {k: spec[k] for k in ("image_size", "patch_size", "width", "layers", "head_width")}
    own = TIMM_VISION_KEYS | set(measured) | set(DROPOUT_DEFAULTS)
    own |= {"mlp_ratio", "norm_kwargs", "patch_dropout", "ls_init_value"}
    bad += [f"vision_cfg.{k} (not an option of a timm tower)" for k in cfg if k not in own]
    for k, v in measured.items():
        if k in cfg and cfg[k] != v:  # OpenCLIP's TimmModel builds timm's numbers whatever the JSON says
            bad.append(f"vision_cfg.{k}={cfg[k]!r} (timm's {name} has {v})")
    width = spec["width"]
    if "mlp_ratio" in cfg and int(width * float(cfg["mlp_ratio"])) != int(width * spec["mlp_ratio"]):
        bad.append(f"vision_cfg.mlp_ratio={cfg['mlp_ratio']!r} (timm's {name} has {spec['mlp_ratio']:.4f})")
    eps = (cfg.get("norm_kwargs") or {}).get("eps", spec["norm_eps"])
    if eps != spec["norm_eps"]:
        bad.append(f"vision_cfg.norm_kwargs.eps={eps} (timm's {name} has {spec['norm_eps']})")
    out = {k: cfg.get(k, v) for k, v in DROPOUT_DEFAULTS.items()}
    if cfg.get("timm_drop_path") is not None and not cfg.get("drop_path_rate"):
        out["drop_path_rate"] = float(cfg["timm_drop_path"])  # what OpenCLIP hands timm as drop_path_rate
    out.update(measured)
    out.update(
        timm_model_name=name,
        timm_model_pretrained=False,
        timm_pool=pool,
        timm_proj=proj,
        timm_drop_path=cfg.get("timm_drop_path"),
        mlp_ratio=float(cfg.get("mlp_ratio", spec["mlp_ratio"])),
        patch_dropout=float(cfg.get("patch_dropout", 0.0)),
        ls_init_value=None,
        norm_kwargs={"eps": spec["norm_eps"]},
    )
    return out, bad


def unsupported_parts(cfg: dict) -> list[str]:
    """What of an OpenCLIP-schema config dsclip's towers cannot build, per tower and in words (empty: it
    builds): another tower type is named once (a timm or Hugging Face tower, a ResNet, CoCa's decoder), not
    as the list of its options."""
    cfg = cfg.get("model_cfg", cfg)
    vision, text = cfg.get("vision_cfg") or {}, cfg.get("text_cfg") or {}
    out = []
    if cfg.get("multimodal_cfg") is not None:
        out.append("a multimodal text decoder (CoCa)")
    if vision.get("timm_model_name"):
        out += _resolve_timm_vision(vision)[1]
    elif isinstance(vision.get("layers"), (list, tuple)):
        out.append("a ResNet vision tower (vision_cfg.layers is a list)")
    if text.get("hf_model_name"):
        out.append(f"text tower hf:{text['hf_model_name']} (dsclip builds OpenCLIP's own text transformer)")
    sections = [("vision_cfg", vision, VISION_FIXED, "timm_model_name")]  # a timm tower: checked above
    sections.append(("text_cfg", text, TEXT_FIXED, "hf_model_name"))
    for name, section, fixed, other_tower in sections:
        if section.get(other_tower):
            continue  # that tower's options belong to the tower type named above
        for k, v in section.items():
            if k in fixed and v != fixed[k] and not (fixed[k] is None and not v):
                out.append(f"{name}.{k}={v!r}")
    if text.get("act_kwargs") and text["act_kwargs"] not in TEXT_ACT_KWARGS:
        out.append(f"text_cfg.act_kwargs={text['act_kwargs']!r}")
    unknown = [k for k in cfg if k not in TOP_KEYS and k not in TOP_FIXED and k != "multimodal_cfg"]
    out += [f"{k} (unknown key)" for k in unknown]
    return out


def resolve_model_config(cfg: dict) -> dict:
    """Validate an OpenCLIP-schema model config and return a deep copy with all defaults filled in."""
    cfg = copy.deepcopy(cfg)
    if "model_cfg" in cfg:  # open_clip_config.json / dsclip config.json wrapper
        cfg = cfg["model_cfg"]
    missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if k not in cfg]
    if missing:
        raise ValueError(f"model config lacks required keys {missing}")
    bad = [k for k in cfg if k not in TOP_KEYS and k not in TOP_FIXED]
    bad += [f"{k}={cfg[k]!r}" for k in TOP_FIXED if k in cfg and cfg[k] != TOP_FIXED[k]]
    if bad:
        raise ValueError(f"unsupported model-config options: {bad}")

    if cfg["vision_cfg"].get("timm_model_name"):
        vision, bad = _resolve_timm_vision(cfg["vision_cfg"])
        if bad:
            raise ValueError("unsupported model-config options: " + "; ".join(bad))
    else:
        vision = _check_section("vision_cfg", cfg["vision_cfg"], VISION_DEFAULTS, VISION_FIXED)
    text = _check_section("text_cfg", cfg["text_cfg"], TEXT_DEFAULTS, TEXT_FIXED, TEXT_PASSTHROUGH)
    if isinstance(vision["layers"], (list, tuple)):
        raise ValueError("ResNet vision towers (vision_cfg.layers as a list) are not supported")
    if vision["width"] % vision["head_width"]:
        raise ValueError(f"vision width {vision['width']} is not a multiple of head_width {vision['head_width']}")
    if text["width"] % text["heads"]:
        raise ValueError(f"text width {text['width']} is not a multiple of heads {text['heads']}")
    if text["act_kwargs"] and text["act_kwargs"] not in TEXT_ACT_KWARGS:
        raise ValueError(f"text_cfg.act_kwargs={text['act_kwargs']!r}; dsclip builds GELU with {TEXT_ACT_KWARGS}")
    if text["pool_type"] not in TEXT_POOL_TYPES:
        raise ValueError(f"text_cfg.pool_type={text['pool_type']!r}; expected one of {TEXT_POOL_TYPES}")
    if not 0.0 <= float(vision["patch_dropout"]) < 1.0:
        raise ValueError(f"vision_cfg.patch_dropout must be in [0, 1), got {vision['patch_dropout']}")

    out = {"embed_dim": int(cfg["embed_dim"]), "quick_gelu": bool(cfg.get("quick_gelu", False))}
    if cfg.get("custom_text"):
        out["custom_text"] = True
    if cfg.get("init_logit_bias") is not None:
        out["init_logit_bias"] = float(cfg["init_logit_bias"])
    if cfg.get("init_logit_scale") is not None:
        out["init_logit_scale"] = float(cfg["init_logit_scale"])
    out["vision_cfg"] = vision
    out["text_cfg"] = text
    return out


def init_logit_scale(cfg: dict) -> float:
    """OpenCLIP's choice: ln(1/0.07) for CLIP, ln(10) for SigLIP (a config with init_logit_bias)."""
    if cfg.get("init_logit_scale") is not None:
        return float(cfg["init_logit_scale"])
    return math.log(10.0) if cfg.get("init_logit_bias") is not None else math.log(1 / 0.07)
