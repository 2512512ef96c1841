"""The cheaper CPU training transform: encoded image bytes -> uint8 (3, H, W), statistically
OpenCLIP's RandomResizedCrop(scale, ratio=(3/4, 4/3), bicubic) with no flip (OpenCLIP's plain
training transform has none).

Where today's path decodes the full image, copies it to RGB, crops, resizes and converts to float in
the worker, this one
* draws the crop on the stored size (the header is read, not the pixels), with the same torch draws
  as torchvision's ``RandomResizedCrop.get_params`` -- so under the per-batch ``seeded_rngs`` the crop
  boxes are the ones today's path draws, and a resumed run sees the same crops;
* decodes a JPEG at a reduced DCT scale (PIL ``draft``: 1/2, 1/4, 1/8) when the crop region still
  has at least the output resolution at that scale;
* crops and resizes in one PIL call (``resize(box=...)``) on the drafted image, in uint8;
* where no DCT scale applies (most LAION-sized photos: shorter side 256-512 px for a 224 crop), decodes
  an RGB/greyscale JPEG with ``torchvision.io.decode_jpeg`` (libjpeg-turbo into a tensor) and crops and
  resizes with torch's antialiased bicubic on uint8 (:func:`crop_resize`, the GPU path's own function):
  ~1.5x cheaper than PIL's decode + resize here, within one level of PIL's pixels (the same filter,
  rounded in float);
* ships uint8: the float conversion and normalisation run in the training process
  (dsclip.data.device_transform).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from .transforms import parse_aug_cfg

DEFAULT_SCALE = (0.9, 1.0)  # OpenCLIP's default crop scale
DEFAULT_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # torchvision's RandomResizedCrop default, which OpenCLIP keeps


def crop_params(width: int, height: int, scale: Sequence[float], ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """(top, left, h, w) exactly as torchvision's ``RandomResizedCrop.get_params`` draws them from
    torch's RNG (same draws in the same order), computed from the size alone."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: the central crop, as torchvision
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def decode_jpeg_rgb(data, device: torch.device | str = "cpu"):
    """``torchvision.io.decode_jpeg`` to RGB: one 1-D uint8 tensor or a list of them (batched on a GPU)."""
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its image IO for torchcodec, once per call
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def crop_resize(image: torch.Tensor, box: Sequence[int], size: Sequence[int]) -> torch.Tensor:
    """uint8 (3, h, w) -> uint8 (3, *size): the crop ``box`` = (top, left, height, width), resized as
    OpenCLIP's RandomResizedCrop resizes (bicubic with antialiasing, PIL's filter) on whatever device
    the image is. torchvision computes uint8 bicubic in float and rounds back to uint8."""
    top, left, h, w = (int(v) for v in box)
    return TF.resized_crop(image, top, left, h, w, list(size), InterpolationMode.BICUBIC, antialias=True)


class FastTrainTransform:
    """bytes -> uint8 (3, H, W) (see the module docstring). ``takes_bytes`` tells the dataset to pass
    the encoded sample instead of a decoded PIL image."""

    takes_bytes = True

    def __init__(
        self,
        size: tuple[int, int],
        scale=DEFAULT_SCALE,
        ratio=DEFAULT_RATIO,
        draft: bool = True,
        tensor_decode: bool = True,
    ):
        self.size = (int(size[0]), int(size[1]))  # (H, W)
        self.scale, self.ratio, self.draft = tuple(scale), tuple(ratio), draft
        # a JPEG no DCT scale can shrink: torchvision's decode_jpeg (libjpeg-turbo straight into a tensor)
        # and torch's antialiased bicubic on uint8, the GPU path's own functions run on CPU; on LAION-sized
        # photos (shorter side 256-512) ~1.5x cheaper than PIL's decode + resize (bench/real_photos.py)
        self.tensor_decode = tensor_decode

    def __call__(self, data: bytes) -> torch.Tensor:
        img = Image.open(io.BytesIO(data))
        W, H = img.size
        i, j, h, w = crop_params(W, H, self.scale, self.ratio)
        out_h, out_w = self.size
        if self.draft and img.format == "JPEG":
            # the largest DCT scale at which the crop box keeps >= the output size in both sides
            img.draft("RGB", (math.ceil(W * out_w / w), math.ceil(H * out_h / h)))
        if self.tensor_decode and img.size == (W, H) and img.format == "JPEG" and img.mode in ("RGB", "L"):
            pixels = decode_jpeg_rgb(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return crop_resize(pixels, (i, j, h, w), self.size)
        sx, sy = img.size[0] / W, img.size[1] / H
        if img.mode not in ("RGB", "L"):  # palette/alpha/CMYK: to RGB first (a palette can't be resampled)
            img = img.convert("RGB")
        img = img.resize((out_w, out_h), Image.BICUBIC, box=(j * sx, i * sy, (j + w) * sx, (i + h) * sy))
        if img.mode != "RGB":  # grey resized as one channel, then expanded (equal to expanding first)
            img = img.convert("RGB")
        return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)

    def __repr__(self) -> str:
        return (
            f"FastTrainTransform(size={self.size}, scale={self.scale}, ratio={self.ratio}, draft={self.draft}, "
            f"tensor_decode={self.tensor_decode})"
        )


def fast_train_transform(image_size: int | Sequence[int], aug_cfg: Mapping[str, Any] | None = None):
    """The fast transform for these settings, or None where it does not apply (``use_timm``, colour
    jitter or grayscale: those stay on the PIL path, ``image_transform``)."""
    aug = {k: v for k, v in parse_aug_cfg(dict(aug_cfg or {})).items() if v is not None}
    if aug.get("use_timm") or aug.get("color_jitter_prob") or aug.get("gray_scale_prob"):
        return None
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size[-2:])
    return FastTrainTransform(size, scale=aug.get("scale", DEFAULT_SCALE))
