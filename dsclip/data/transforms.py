"""OpenCLIP-style image transforms (train: RandomResizedCrop; eval: resize + center crop).

Everything here is a plain module-level class or torchvision transform so it pickles into
DataLoader worker processes (no lambdas).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchvision import transforms as T

# OpenAI CLIP's statistics, which OpenCLIP uses for every CLIP model it trains.
OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)

_INTERPOLATION = {
    "bicubic": T.InterpolationMode.BICUBIC,
    "bilinear": T.InterpolationMode.BILINEAR,
    "nearest": T.InterpolationMode.NEAREST,
}


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


def image_transform(
    image_size: int | Sequence[int],
    is_train: bool,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    interpolation: str = "bicubic",
    scale: tuple[float, float] = (0.9, 1.0),
) -> T.Compose:
    """The OpenCLIP transform for a PIL image -> normalized float tensor (3, H, W).

    Train: RandomResizedCrop(image_size, scale=(0.9, 1.0)) — OpenCLIP's default crop scale, far
    milder than ImageNet's (0.08, 1) because the caption often describes the whole image.
    Eval: Resize(shorter side -> image_size) + CenterCrop(image_size).
    """
    mean = tuple(mean or OPENAI_DATASET_MEAN)
    std = tuple(std or OPENAI_DATASET_STD)
    if interpolation not in _INTERPOLATION:
        raise ValueError(f"interpolation must be one of {sorted(_INTERPOLATION)}, got {interpolation!r}")
    interp = _INTERPOLATION[interpolation]
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    to_tensor = ToNormalizedTensor(mean, std)  # = T.ToTensor() + T.Normalize(mean, std)
    if is_train:
        return T.Compose([T.RandomResizedCrop(size, scale=scale, interpolation=interp), ConvertToRGB(), to_tensor])
    # Resize the shorter side to the target then center-crop, so the aspect ratio is kept.
    resize_to = size[0] if size[0] == size[1] else size
    return T.Compose(
        [
            T.Resize(resize_to, interpolation=interp),
            T.CenterCrop(size),
            ConvertToRGB(),
            to_tensor,
        ]
    )


def normalize_uint8(images: torch.Tensor, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD) -> torch.Tensor:
    """uint8 (..., 3, H, W) or float in [0, 1] -> float normalized with the CLIP mean/std."""
    x = images.float()
    if images.dtype == torch.uint8:
        x = x / 255.0
    m = torch.tensor(mean, dtype=x.dtype).view(3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(3, 1, 1)
    return (x - m) / s
