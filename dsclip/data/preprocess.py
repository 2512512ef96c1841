"""The image settings OpenCLIP's flags take (``--image-mean``, ``--image-std``, ``--image-interpolation``,
``--image-resize-mode``, ``--aug-cfg``), parsed and checked; dsclip.data.transforms composes the transforms.

Why apart from the transforms: the run config (``DataConfig``) checks these while parsing, and
``dsclip train --help`` and the checks before the process group must not import torch, torchvision or
timm (issue #33). Plain Python only.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from dsclip.config_base import ConfigError

# OpenAI CLIP's statistics, which OpenCLIP uses for every CLIP model it trains.
OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)


INTERPOLATIONS = ("bicubic", "bilinear", "random")  # OpenCLIP's --image-interpolation choices
RESIZE_MODES = ("shortest", "longest", "squash")  # OpenCLIP's --image-resize-mode choices

# OpenCLIP's AugmentationCfg fields (open_clip/transform.py) and what each value must look like.
AUG_KEYS = {
    "scale": "two numbers (min, max) of the crop area, e.g. scale=(0.5,1.0)",
    "ratio": "two numbers (min, max) of the crop aspect ratio, e.g. ratio=(0.75,1.33)",
    "color_jitter": "one number or 3-4 numbers (brightness, contrast, saturation[, hue])",
    "color_jitter_prob": "a probability in [0, 1]",
    "gray_scale_prob": "a probability in [0, 1]",
    "re_prob": "a probability in [0, 1] (random erasing, with use_timm=True)",
    "re_count": "a positive integer (random erasing, with use_timm=True)",
    "use_timm": "True or False",
}
# Without use_timm OpenCLIP reads only these (it warns that the others are unused).
_NON_TIMM_KEYS = ("scale", "color_jitter", "color_jitter_prob", "gray_scale_prob", "use_timm")


def _is_num(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _nums(v, lengths: tuple[int, ...]) -> bool:
    return isinstance(v, (list, tuple)) and len(v) in lengths and all(_is_num(x) for x in v)


def _aug_value_ok(key: str, v) -> bool:
    if key in ("scale", "ratio"):
        return _nums(v, (2,)) and 0 < v[0] <= v[1]
    if key == "color_jitter":
        return (_is_num(v) and v >= 0) or (_nums(v, (3, 4)) and all(x >= 0 for x in v))
    if key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        return _is_num(v) and 0 <= v <= 1
    if key == "re_count":
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1
    return isinstance(v, bool)  # use_timm


def parse_aug_cfg(value: Any) -> dict[str, Any]:
    """``--aug-cfg`` as OpenCLIP reads it (``key=value`` words, each value a Python literal, else a
    string), or a recipe's mapping -> a checked dict (sequences as lists, so the run config is plain
    YAML). Raises ConfigError naming the key and what it takes."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = value.split()
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    else:
        items = []
        for word in value:
            key, eq, text = str(word).partition("=")
            if not eq or not key:
                raise ConfigError(f"--aug-cfg takes key=value pairs (e.g. scale='(0.5,1.0)'), got {word!r}")
            try:
                items.append((key, ast.literal_eval(text)))
            except (ValueError, SyntaxError):
                items.append((key, text))  # OpenCLIP keeps an unparsable value as a string
    out: dict[str, Any] = {}
    for key, v in items:
        if key not in AUG_KEYS:
            raise ConfigError(f"--aug-cfg: unknown key {key!r}; OpenCLIP's keys are {', '.join(AUG_KEYS)}")
        v = list(v) if isinstance(v, tuple) else v
        if v is not None and not _aug_value_ok(key, v):
            raise ConfigError(f"--aug-cfg {key}={v!r}: {key} takes {AUG_KEYS[key]}")
        out[key] = v
    if out.get("color_jitter_prob") and not out.get("use_timm") and not _nums(out.get("color_jitter"), (4,)):
        raise ConfigError(
            "--aug-cfg color_jitter_prob needs color_jitter with 4 values, e.g. color_jitter='(0.4,0.4,0.4,0.1)'"
        )
    return out


def check_mean_std(name: str, values: Sequence[float] | None) -> None:
    """OpenCLIP normalizes with one value for all channels or one per RGB channel."""
    if values is None:
        return
    if len(values) not in (1, 3):
        raise ConfigError(f"--{name} takes 3 values (R G B) or 1 for all channels, got {len(values)}: {list(values)}")
    if name == "image-std" and any(v <= 0 for v in values):
        raise ConfigError(f"--image-std values must be positive, got {list(values)}")


def per_channel(values: Sequence[float] | float | None, default: tuple[float, float, float]) -> tuple[float, ...]:
    """A mean/std setting as 3 values: None -> ``default``; one value -> repeated for R, G and B."""
    if values is None or (isinstance(values, Sequence) and len(values) == 0):
        return default
    if not isinstance(values, Sequence):
        return (float(values),) * 3
    return tuple(float(v) for v in values) * (3 if len(values) == 1 else 1)


# OpenCLIP preprocess_cfg key -> the DataConfig field (and flag) that sets it
PREPROCESS_FIELDS = {
    "mean": "image_mean",
    "std": "image_std",
    "interpolation": "image_interpolation",
    "resize_mode": "image_resize_mode",
}


def openclip_preprocess_cfg(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``preprocess_cfg`` entries of ``open_clip_config.json`` that a run's data section sets
    (``image_mean``, ``image_std``, ``image_interpolation``, ``image_resize_mode``); unset ones are left
    to the defaults. OpenCLIP's preprocess config has no augmentation: ``aug_cfg`` stays in the run."""
    out: dict[str, Any] = {}
    for key, name in PREPROCESS_FIELDS.items():
        if data.get(name):
            value = data[name]
            out[key] = list(per_channel(value, OPENAI_DATASET_MEAN)) if key in ("mean", "std") else value
    return out


def preprocess_settings(preprocess_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse: an OpenCLIP ``preprocess_cfg`` -> DataConfig settings (``image_mean``, ...)."""
    return {name: preprocess_cfg[key] for key, name in PREPROCESS_FIELDS.items() if preprocess_cfg.get(key)}
