"""The training-process side of the uint8 input: workers ship uint8 (B, 3, H, W) images (4x less
pinned memory and host-to-device traffic than float32) and the float conversion and normalisation
run here, on the device the step runs on.

``normalize_on_device`` uses the same two in-place ops as the worker-side ``ToNormalizedTensor``
(subtract mean*255, multiply by 1/(std*255)), so on CPU the result is bit-equal to today's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def normalize_on_device(
    uint8_batch: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> normalised ``dtype`` on ``device`` (default: where the batch is).

    The arithmetic runs in float32 (then cast) so bf16 training gets the same rounding as a float32
    batch cast by the step."""
    if uint8_batch.dtype != torch.uint8:
        raise TypeError(f"normalize_on_device takes a uint8 batch, got {uint8_batch.dtype}")
    x = uint8_batch.to(device or uint8_batch.device, non_blocking=True).to(torch.float32)
    shift = torch.tensor(tuple(mean), dtype=torch.float32, device=x.device).view(3, 1, 1) * 255.0
    scale = 1.0 / (torch.tensor(tuple(std), dtype=torch.float32, device=x.device).view(3, 1, 1) * 255.0)
    x = x.sub_(shift).mul_(scale)
    return x if dtype == torch.float32 else x.to(dtype)


class DevicePrep:
    """What TrainData applies to each batch in the training process: uint8 images -> normalised
    floats on ``device`` (CPU until the trainer calls ``TrainData.set_device``); float batches pass."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = tuple(mean), tuple(std)
        self.device: torch.device | str = "cpu"
        self.dtype = torch.float32

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        return normalize_on_device(images, self.mean, self.std, self.dtype, self.device)

    def prepare(self, images, tokens):
        """-> (images, tokens, counts): the interface TrainData calls (the GPU path's prep also counts)."""
        return self(images), tokens, {}


class SideStream:
    """The CUDA stream the next batch is prepared on while the current step runs (TrainData reads one
    batch ahead). On a CPU device there is no stream: the context is a null one and the hand-over a
    no-op, so the same TrainData code runs in CI.

    ``hand_over`` makes the step's (current) stream wait for what was queued on this stream so far and
    marks the tensors as used by the current stream (``record_stream``), so the caching allocator does
    not hand their memory to the side stream's next batch while the step still reads them. TrainData
    hands batch n over *before* it queues batch n+1 here, so the step never waits for n+1's decode."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def bind_thread(self) -> None:
        """In the read-ahead thread: CUDA's current device is per thread, and a new one starts on 0."""
        if self.stream is not None:
            torch.cuda.set_device(self.stream.device)

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def hand_over(self, images: torch.Tensor) -> None:
        """``images``: the prepared batch, on the device (tokens stay on the host: the step moves them)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        images.record_stream(current)
