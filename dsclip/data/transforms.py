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

import contextlib
import random
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from timm.data import create_transform
from timm.data.transforms import CenterCropOrPad, ResizeKeepRatio
from torchvision import transforms as T

# the settings (and their checks) live without torch/timm, for the run config's parser (issue #33)
from dsclip.data.preprocess import (  # noqa: F401 (re-exported: the transforms' settings)
    _NON_TIMM_KEYS,
    AUG_KEYS,
    INTERPOLATIONS,
    OPENAI_DATASET_MEAN,
    OPENAI_DATASET_STD,
    PREPROCESS_FIELDS,
    RESIZE_MODES,
    check_mean_std,
    openclip_preprocess_cfg,
    parse_aug_cfg,
    per_channel,
    preprocess_settings,
)


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
    resize_mode = resize_mode or "shortest"
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size[-2:])
    to_tensor = ToNormalizedTensor(mean, std)  # = T.ToTensor() + T.Normalize(mean, std)

    if is_train:
        return _train_transform(size, aug_cfg, mean, std, interpolation, to_tensor)
    return _eval_transform(size, resize_mode, fixed, fill_color, to_tensor)


def _train_transform(size, aug_cfg, mean, std, interpolation, to_tensor):
    """OpenCLIP's training transform: timm's ``create_transform`` with ``use_timm``, else a bicubic
    RandomResizedCrop with OpenCLIP's optional color jitter and grayscale."""
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
    if unused:  # stacklevel 3: the caller of image_transform
        warnings.warn(f"--aug-cfg {', '.join(unused)} unused without use_timm=True (as in OpenCLIP)", stacklevel=3)
    steps = [
        T.RandomResizedCrop(size, scale=tuple(aug.get("scale", (0.9, 1.0))), interpolation=T.InterpolationMode.BICUBIC),
        ConvertToRGB(),
    ]
    if aug.get("color_jitter_prob"):
        steps.append(RandomApplyPy(T.ColorJitter(*aug["color_jitter"]), aug["color_jitter_prob"]))
    if aug.get("gray_scale_prob"):
        steps.append(RandomApplyPy(T.Grayscale(num_output_channels=3), aug["gray_scale_prob"]))
    return T.Compose([*steps, to_tensor])


def _eval_transform(size, resize_mode, fixed, fill_color, to_tensor):
    """OpenCLIP's eval transform: resize by the shortest side + center crop, by the longest side + center
    crop-or-pad, or a squash resize (``fixed``: the bilinear/bicubic resize interpolation)."""
    interp = T.InterpolationMode(fixed)
    if resize_mode == "longest":
        steps = [ResizeKeepRatio(size, longest=1, interpolation=fixed), CenterCropOrPad(size, fill=fill_color)]
    elif resize_mode == "squash":
        steps = [T.Resize(size, interpolation=interp)]
    elif size[0] == size[1]:  # shortest side -> the target, then center-crop: the aspect ratio is kept
        steps = [T.Resize(size[0], interpolation=interp), T.CenterCrop(size)]
    else:  # as OpenCLIP: a non-square target resizes (bicubic) by the side that fits, then crops
        steps = [ResizeKeepRatio(size, interpolation="bicubic"), T.CenterCrop(size)]
    return T.Compose([*steps, ConvertToRGB(), to_tensor])
