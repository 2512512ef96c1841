"""OpenCLIP-style image transforms (train: RandomResizedCrop; eval: resize + center crop).

Everything here is a plain module-level class or torchvision transform so it pickles into
DataLoader worker processes (no lambdas).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    normalize = T.Normalize(mean=mean, std=std)
    if is_train:
        return T.Compose(
            [
                T.RandomResizedCrop(size, scale=scale, interpolation=interp),
                ConvertToRGB(),
                T.ToTensor(),
                normalize,
            ]
        )
    # Resize the shorter side to the target then center-crop, so the aspect ratio is kept.
    resize_to = size[0] if size[0] == size[1] else size
    return T.Compose([T.Resize(resize_to, interpolation=interp), T.CenterCrop(size), ConvertToRGB(), T.ToTensor(), normalize])


def normalize_uint8(images: torch.Tensor, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD) -> torch.Tensor:
    """uint8 (..., 3, H, W) or float in [0, 1] -> float normalized with the CLIP mean/std."""
    x = images.float()
    if images.dtype == torch.uint8:
        x = x / 255.0
    m = torch.tensor(mean, dtype=x.dtype).view(3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(3, 1, 1)
    return (x - m) / s
