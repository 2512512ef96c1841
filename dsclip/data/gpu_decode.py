"""The GPU input path (``--data-decode gpu``; ``auto`` where CUDA is present): workers ship encoded
JPEG bytes and a crop box, the training process decodes the batch with nvJPEG and crops, resizes and
normalises it on the device.

Worker side (:class:`EncodedTrainTransform`, :meth:`EncodedBatch.collate`): the image header is read
(size, format, mode: no pixels), the crop box is drawn with :func:`~dsclip.data.fast_transforms.crop_params`
under the per-batch ``seeded_rngs`` -- the same draws the CPU paths make, so a resumed run sees the same
crops -- and the encoded bytes travel with the box. Images nvJPEG does not take (not a JPEG: PNG,
WebP, GIF; CMYK/YCCK JPEGs, which PIL opens as mode CMYK) are decoded in the worker by the CPU path's
:class:`~dsclip.data.fast_transforms.FastTrainTransform` (it draws the same box) and shipped as uint8,
counted as ``cpu_decoded_image``. Progressive JPEGs stay on the GPU: torchvision decodes them with
nvJPEG's software (hybrid) backend, baseline ones with the hardware decoder where the GPU has one.

Training side (:func:`decode_jpegs`, :func:`crop_resize`, :func:`decode_batch`, :class:`GpuDecodePrep`):
every function takes a ``device``; on CPU the same code runs with ``torchvision.io.decode_jpeg`` on CPU
tensors (libjpeg-turbo), which is how the tests run it. A batched decode that fails is retried per
sample; a sample the device cannot decode is decoded on CPU (``cpu_decoded_image``); one that fails
there too is dropped (``corrupt_image``, as the worker counts corrupt images) and its row is given
another good row of the same batch, image and caption together, so the batch keeps its size and the
rest of it is trained on.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from .device_transform import normalize_on_device
from .fast_transforms import DEFAULT_RATIO, DEFAULT_SCALE, FastTrainTransform, crop_params, crop_resize, decode_jpeg_rgb

CPU_DECODED = "cpu_decoded_image"  # decoded on CPU instead of nvJPEG (trained on: not a bad sample)
CORRUPT = "corrupt_image"  # the worker path's reason for an image that does not decode

# PIL's format/mode pairs that nvJPEG decodes to RGB (MPO: a camera's multi-picture JPEG, its first frame)
_NVJPEG_FORMATS = ("JPEG", "MPO")
_NVJPEG_MODES = ("RGB", "L")


# -- worker side ---------------------------------------------------------------------------------------
class Encoded(NamedTuple):
    """One worker-side sample: the encoded JPEG and its crop box, or (fallback) the decoded uint8 crop."""

    data: bytes | None
    box: tuple[int, int, int, int] | None  # (top, left, height, width) in stored pixels
    image: torch.Tensor | None  # uint8 (3, H, W) at the output size, decoded in the worker


def nvjpeg_decodes(img: Image.Image) -> bool:
    """Whether nvJPEG takes this opened (not decoded) image: a JPEG in RGB (YCbCr) or greyscale."""
    return img.format in _NVJPEG_FORMATS and img.mode in _NVJPEG_MODES


class EncodedTrainTransform:
    """bytes -> :class:`Encoded` (see the module docstring). ``collate`` builds the batch the worker ships."""

    takes_bytes = True

    def __init__(self, size: tuple[int, int], scale=DEFAULT_SCALE, ratio=DEFAULT_RATIO):
        self.size = (int(size[0]), int(size[1]))  # (H, W)
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        # the fallback (the CPU path's transform) draws the same box from the same RNG state
        self.cpu = FastTrainTransform(self.size, self.scale, self.ratio)

    def __call__(self, data: bytes) -> Encoded:
        with Image.open(io.BytesIO(data)) as img:  # the header only
            if not nvjpeg_decodes(img):
                return Encoded(None, None, self.cpu(data))
            W, H = img.size
        return Encoded(data, crop_params(W, H, self.scale, self.ratio), None)

    @staticmethod
    def collate(samples: Sequence[Encoded]) -> EncodedBatch:
        return EncodedBatch.collate(samples)

    def __repr__(self) -> str:
        return f"EncodedTrainTransform(size={self.size}, scale={self.scale}, ratio={self.ratio})"


def cpu_decoded_count(sample) -> int:
    """1 for a sample the worker decoded itself (the CPU fallback), else 0."""
    return int(isinstance(sample, Encoded) and sample.image is not None)


@dataclass
class EncodedBatch:
    """What a worker ships per batch on the GPU path: B rows, each encoded bytes + box or a decoded crop.

    A few tensors per batch rather than one per sample: each tensor crossing the worker queue costs a
    shared-memory handle."""

    data: torch.Tensor  # uint8 (N,): the encoded rows' bytes, concatenated
    offsets: torch.Tensor  # int64 (B + 1,): row r's bytes are data[offsets[r]:offsets[r + 1]] (empty: decoded)
    boxes: torch.Tensor  # int64 (B, 4): (top, left, height, width) of each encoded row's crop
    decoded: torch.Tensor  # uint8 (F, 3, H, W): the rows the worker decoded (the fallback)...
    decoded_rows: torch.Tensor  # int64 (F,): ...and which rows they are

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def collate(cls, samples: Sequence[Encoded]) -> EncodedBatch:
        lengths = [len(s.data) if s.data is not None else 0 for s in samples]
        data = torch.empty(sum(lengths), dtype=torch.uint8)
        if len(data):
            data.numpy()[:] = np.frombuffer(b"".join(s.data for s in samples if s.data is not None), np.uint8)
        offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
        boxes = torch.tensor([s.box if s.box is not None else (0, 0, 0, 0) for s in samples], dtype=torch.int64)
        rows = [r for r, s in enumerate(samples) if s.image is not None]
        decoded = torch.stack([samples[r].image for r in rows]) if rows else torch.empty(0, dtype=torch.uint8)
        return cls(data, offsets, boxes.view(-1, 4), decoded, torch.tensor(rows, dtype=torch.int64))

    def encoded(self, row: int) -> torch.Tensor | None:
        """Row ``row``'s encoded bytes as a 1-D uint8 view (None for a row decoded in the worker)."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        return self.data[a:b] if b > a else None

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pin thread calls this: only the decoded crops are copied to the device as
        they are; nvJPEG stages the encoded bytes through its own pinned buffers."""
        return EncodedBatch(self.data, self.offsets, self.boxes, self.decoded.pin_memory(), self.decoded_rows)


# -- training-process side ---------------------------------------------------------------------------
def _decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return decode_jpeg_rgb(data, device)


def decode_jpegs(data: list[torch.Tensor], device: torch.device | str) -> tuple[list[torch.Tensor | None], Counter]:
    """Encoded JPEGs (1-D uint8 CPU tensors) -> uint8 (3, h, w) images on ``device``, one call for the
    batch (nvJPEG's batched decode on CUDA). If the batched call fails (it returns nothing then), each
    sample is decoded alone; a sample that fails on the device is decoded on CPU and moved; one that
    fails there too is None. Returns the images and the counts (cpu_decoded_image, corrupt_image)."""
    device = torch.device(device)
    counts: Counter = Counter()
    if not data:
        return [], counts
    try:
        return list(_decode(data, device)), counts
    except RuntimeError:
        pass  # one bad sample fails the whole call: find it
    out: list[torch.Tensor | None] = []
    for d in data:
        img = None
        try:
            (img,) = _decode([d], device)
        except RuntimeError:
            if device.type != "cpu":
                try:
                    (img,) = _decode([d], torch.device("cpu"))
                    img = img.to(device)
                    counts[CPU_DECODED] += 1
                except RuntimeError:
                    pass
        if img is None:
            counts[CORRUPT] += 1
        out.append(img)
    return out, counts


def decode_batch(
    batch: EncodedBatch, tokens: torch.Tensor, size: Sequence[int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, Counter]:
    """An :class:`EncodedBatch` -> (uint8 (B, 3, *size) on ``device``, tokens, counts). A row whose
    image fails everywhere takes another good row's image and tokens (the next good row: a choice that
    depends only on the batch, so a resumed run makes it too)."""
    device = torch.device(device)
    B = len(batch)
    out = torch.empty(B, 3, *size, dtype=torch.uint8, device=device)
    ok = torch.zeros(B, dtype=torch.bool)
    if len(batch.decoded_rows):
        out[batch.decoded_rows.to(device)] = batch.decoded.to(device, non_blocking=True)
        ok[batch.decoded_rows] = True
    rows = [r for r in range(B) if batch.encoded(r) is not None]
    images, counts = decode_jpegs([batch.encoded(r) for r in rows], device)
    for r, img in zip(rows, images):
        if img is not None:
            out[r] = crop_resize(img, batch.boxes[r].tolist(), size)
            ok[r] = True
    good = ok.nonzero().flatten().tolist()
    if len(good) < B:
        if not good:  # the worker read every header fine; all B failing to decode is not data to train on
            raise RuntimeError(f"none of the {B} images of a batch decodes (on {device} or CPU): corrupt shards?")
        tokens = tokens.clone()
        for r in (r for r in range(B) if not ok[r]):
            k = next((g for g in good if g > r), good[0])
            out[r], tokens[r] = out[k], tokens[k]
    return out, tokens, counts


class GpuDecodePrep:
    """What TrainData applies to each batch of the GPU path in the training process (the role
    :class:`~dsclip.data.device_transform.DevicePrep` has for the CPU path): :class:`EncodedBatch` ->
    normalised floats on ``device`` (CPU until the trainer calls ``TrainData.set_device``)."""

    def __init__(self, size: Sequence[int], mean: Sequence[float], std: Sequence[float]):
        self.size = (int(size[0]), int(size[1]))
        self.mean, self.std = tuple(mean), tuple(std)
        self.device: torch.device | str = "cpu"
        self.dtype = torch.float32

    def prepare(self, images, tokens):
        """-> (images, tokens, counts)."""
        if not isinstance(images, EncodedBatch):
            raise TypeError(f"the GPU input path takes EncodedBatch from its workers, got {type(images).__name__}")
        u8, tokens, counts = decode_batch(images, tokens, self.size, self.device)
        return normalize_on_device(u8, self.mean, self.std, self.dtype), tokens, counts
