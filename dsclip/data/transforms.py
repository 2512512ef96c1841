"""OpenCLIP's image transforms with OpenCLIP's settings (``--image-mean``, ``--image-std``,
``--image-interpolation``, ``--image-resize-mode``, ``--aug-cfg``), composed as
``open_clip.transform.image_transform`` composes them, from torchvision's and timm's transforms.

Train: RandomResizedCrop(scale) [+ color jitter / grayscale with a probability] or, with
``use_timm=True``, timm's ``create_transform`` with OpenCLIP's arguments. Eval: resize by the shortest
side + center crop, by the longest side + center crop-or-pad, or a squash resize.

Everything here is a module-level class or a torchvision/timm transform so it pickles into DataLoader
worker processes (no lambdas).
"""

from __future__ import annotations

import ast
import contextlib
import random
import warnings
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch
from timm.data import create_transform
from timm.data.transforms import CenterCropOrPad, ResizeKeepRatio
from torchvision import transforms as T

from dsclip.config_base import ConfigError

# OpenAI CLIP's statistics, which OpenCLIP uses for every CLIP model it trains.
OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)


class ConvertToRGB:
    """PIL image -> RGB (drops alpha, expands grey/palette), as OpenCLIP's ``_convert_to_rgb``."""

    def __call__(self, image):
        return image.convert("RGB") if image.mode != "RGB" else image

    def __repr__(self) -> str:
        return "ConvertToRGB()"


class ToNormalizedTensor:
    """PIL RGB -> float (3, H, W) normalized: ToTensor + Normalize fused into one pass of in-place ops
    (the pair costs as much as the JPEG decode when done separately: a float copy, a clone, a divide)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = tuple(mean), tuple(std)
        self._shift = torch.tensor(self.mean).view(3, 1, 1) * 255.0
        self._scale = 1.0 / (torch.tensor(self.std).view(3, 1, 1) * 255.0)

    def __call__(self, image) -> torch.Tensor:

        arr = np.array(image, dtype=np.uint8)  # writable copy (asarray of a PIL image is read-only)
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=2)
        x = torch.from_numpy(arr).permute(2, 0, 1).to(torch.float32)  # (3, H, W), a fresh copy
        return x.sub_(self._shift).mul_(self._scale).contiguous()

    def __repr__(self) -> str:
        return f"ToNormalizedTensor(mean={self.mean}, std={self.std})"


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


class RandomApplyPy:
    """Apply ``transform`` with probability ``p``, drawn from Python's ``random`` as OpenCLIP's
    ``color_jitter``/``gray_scale`` do (torchvision's RandomApply draws from torch, which would change the
    jitter parameters drawn next and so the images)."""

    def __init__(self, transform, p: float):
        self.transform, self.p = transform, float(p)

    def __call__(self, img):
        return self.transform(img) if random.random() < self.p else img

    def __repr__(self) -> str:
        return f"RandomApplyPy({self.transform!r}, p={self.p})"


@contextlib.contextmanager
def seeded_rngs(seed: int):
    """Run augmentation with torch's and Python's RNGs seeded (torchvision draws from torch; timm and
    OpenCLIP's probability gates from ``random``), restoring both afterwards so the training process's
    streams are not disturbed."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(state)


def image_transform(
    image_size: int | Sequence[int],
    is_train: bool,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    resize_mode: str | None = None,
    interpolation: str | None = None,
    fill_color: int = 0,
    aug_cfg: Mapping[str, Any] | None = None,
):
    """PIL image -> normalized float tensor (3, H, W): ``open_clip.transform.image_transform`` with the
    same arguments gives the same images (tests/unit/test_transforms.py).

    As OpenCLIP: the non-timm training crop is always bicubic (``interpolation`` applies to eval and to
    ``use_timm``), ``resize_mode`` applies to eval only, and the default crop scale is (0.9, 1.0) --
    far milder than ImageNet's (0.08, 1) because the caption often describes the whole image.
    """
    mean = per_channel(mean, OPENAI_DATASET_MEAN)
    std = per_channel(std, OPENAI_DATASET_STD)
    interpolation = interpolation or "bicubic"
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    # OpenCLIP: 'random' only means something to timm's training crop; resizing otherwise is bicubic
    fixed = "bilinear" if interpolation == "bilinear" else "bicubic"
    interp = T.InterpolationMode(fixed)
    resize_mode = resize_mode or "shortest"
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size[-2:])
    to_tensor = ToNormalizedTensor(mean, std)  # = T.ToTensor() + T.Normalize(mean, std)

    if is_train:
        aug = {k: v for k, v in parse_aug_cfg(dict(aug_cfg or {})).items() if v is not None}
        if aug.pop("use_timm", False):
            aug.setdefault("scale", (0.9, 1.0))  # OpenCLIP's default crop scale, not timm's (0.08, 1)
            aug.setdefault("color_jitter", None)  # OpenCLIP turns timm's default jitter off
            aug.pop("color_jitter_prob", None)
            aug.pop("gray_scale_prob", None)
            return create_transform(
                input_size=(3, *size),
                is_training=True,
                hflip=0.0,
                mean=mean,
                std=std,
                re_mode="pixel",
                interpolation=interpolation,
                **{k: tuple(v) if isinstance(v, list) else v for k, v in aug.items()},
            )
        unused = sorted(set(aug) - set(_NON_TIMM_KEYS))
        if aug.get("color_jitter") is not None and not aug.get("color_jitter_prob"):
            unused.append("color_jitter")
        if unused:
            warnings.warn(f"--aug-cfg {', '.join(unused)} unused without use_timm=True (as in OpenCLIP)", stacklevel=2)
        steps = [
            T.RandomResizedCrop(
                size, scale=tuple(aug.get("scale", (0.9, 1.0))), interpolation=T.InterpolationMode.BICUBIC
            ),
            ConvertToRGB(),
        ]
        if aug.get("color_jitter_prob"):
            steps.append(RandomApplyPy(T.ColorJitter(*aug["color_jitter"]), aug["color_jitter_prob"]))
        if aug.get("gray_scale_prob"):
            steps.append(RandomApplyPy(T.Grayscale(num_output_channels=3), aug["gray_scale_prob"]))
        return T.Compose([*steps, to_tensor])

    if resize_mode == "longest":
        steps = [ResizeKeepRatio(size, longest=1, interpolation=fixed), CenterCropOrPad(size, fill=fill_color)]
    elif resize_mode == "squash":
        steps = [T.Resize(size, interpolation=interp)]
    elif size[0] == size[1]:  # shortest side -> the target, then center-crop: the aspect ratio is kept
        steps = [T.Resize(size[0], interpolation=interp), T.CenterCrop(size)]
    else:  # as OpenCLIP: a non-square target resizes (bicubic) by the side that fits, then crops
        steps = [ResizeKeepRatio(size, interpolation="bicubic"), T.CenterCrop(size)]
    return T.Compose([*steps, ConvertToRGB(), to_tensor])


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
