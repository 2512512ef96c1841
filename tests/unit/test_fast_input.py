"""The uint8 CPU input path (dsclip.data.fast_transforms + device_transform): OpenCLIP's augmentation
statistics, today's pixels where no draft applies, exact normalisation, and a batch of awkward images."""

import io
import math
import tarfile

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from dsclip.config_base import ConfigError
from dsclip.data import DataConfig, build_train_data
from dsclip.data.device_transform import normalize_on_device
from dsclip.data.fast_transforms import FastTrainTransform, crop_params, fast_train_transform
from dsclip.data.transforms import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, ToNormalizedTensor, image_transform
from tests.unit.test_data_wds import IdTokenizer, _add


def _photo(w, h, seed=0, fmt="JPEG", mode="RGB", quality=92) -> bytes:
    """A smooth, asymmetric test picture (gradients + a few blobs), encoded."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 60 * np.sin(x / 17 + y / 23)], -1)
    base += rng.normal(0, 8, base.shape)
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _openclip_crop():
    pre = open_clip.image_transform(224, is_train=True)
    steps = pre.transforms
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in steps)  # OpenCLIP's train crop never flips
    (rrc,) = [t for t in steps if isinstance(t, T.RandomResizedCrop)]
    return rrc


def test_crop_statistics_match_openclip():
    rrc = _openclip_crop()
    fast = fast_train_transform(224)
    assert fast.scale == tuple(rrc.scale) and fast.ratio == pytest.approx(tuple(rrc.ratio))
    assert rrc.interpolation == T.InterpolationMode.BICUBIC  # and ours resizes with Image.BICUBIC
    n, W, H = 3000, 512, 384

    def stats(draw):
        torch.manual_seed(0)
        area, aspect, cx = [], [], []
        for _ in range(n):
            i, j, h, w = draw()
            area.append(h * w / (W * H))
            aspect.append(w / h)
            cx.append((j + w / 2) / W)
        return np.array(area), np.log(np.array(aspect)), np.array(cx)

    ours = stats(lambda: crop_params(W, H, fast.scale, fast.ratio))
    torch.manual_seed(123)  # openclip's draws on a different stream: statistics, not identity
    theirs = stats(lambda: T.RandomResizedCrop.get_params(Image.new("RGB", (W, H)), rrc.scale, rrc.ratio))
    for a, b in zip(ours, theirs):
        assert abs(a.mean() - b.mean()) < 4 * max(a.std(), 1e-3) / math.sqrt(n)
        assert np.quantile(a, 0.1) == pytest.approx(np.quantile(b, 0.1), abs=0.02)
        assert np.quantile(a, 0.9) == pytest.approx(np.quantile(b, 0.9), abs=0.02)
    assert 0.89 <= ours[0].min() and ours[0].max() <= 1.0 + 1e-9  # (0.9, 1) up to rounding to pixels
    # and under one seed the very same boxes as torchvision's (so today's and resumed runs' crops)
    for size in ((512, 384), (300, 1200), (1, 1), (6000, 4000)):
        torch.manual_seed(7)
        a = [crop_params(*size, (0.5, 1.0), fast.ratio) for _ in range(50)]
        torch.manual_seed(7)
        b = [T.RandomResizedCrop.get_params(Image.new("RGB", size), (0.5, 1.0), fast.ratio) for _ in range(50)]
        assert a == b


def test_no_draft_is_todays_pixels_and_draft_stays_close():
    data = _photo(400, 300)
    fast, today = FastTrainTransform((64, 64), draft=False, tensor_decode=False), image_transform(64, is_train=True)
    for seed in range(5):
        torch.manual_seed(seed)
        x = normalize_on_device(fast(data)[None], OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)[0]
        torch.manual_seed(seed)
        ref = today(Image.open(io.BytesIO(data)).convert("RGB"))
        assert x.shape == ref.shape == (3, 64, 64)
        levels = ((x - ref).abs() * torch.tensor(OPENAI_DATASET_STD).view(3, 1, 1) * 255).round()  # uint8 steps
        # crop+resize in one PIL call = crop, then resize: equal inside; the 2-px border differs by a few
        # levels because resize(box=) lets the bicubic filter read the real pixels just outside the box
        assert levels[:, 2:-2, 2:-2].max() == 0 and levels.max() <= 4
    big = _photo(2000, 1500)
    for seed in range(3):  # 1/8-scale DCT decode (crop >= 1800 px -> >= 225 px drafted) vs the full decode
        torch.manual_seed(seed)
        a = FastTrainTransform((224, 224))(big).float()
        torch.manual_seed(seed)
        b = FastTrainTransform((224, 224), draft=False)(big).float()
        assert (a - b).abs().mean() < 3.0  # of 255: the same picture, not a shifted or different crop


def test_tensor_decode_is_pils_crop_to_bicubic_rounding():
    # torchvision's decode_jpeg (libjpeg-turbo, as PIL's) + torch's antialiased bicubic against PIL's decode +
    # resize, same box (the same seed): both implement PIL's bicubic filter, torch in float then rounded, so a
    # pixel differs by at most one level inside and a few at the 2-px border (PIL reads past the box there)
    data = _photo(400, 300)
    tensor, pil = FastTrainTransform((64, 64)), FastTrainTransform((64, 64), tensor_decode=False)
    for seed in range(5):
        torch.manual_seed(seed)
        a = tensor(data).int()
        torch.manual_seed(seed)
        b = pil(data).int()
        assert a.shape == b.shape == (3, 64, 64) and a.dtype == torch.int32
        diff = (a - b).abs()
        assert diff[:, 2:-2, 2:-2].max() <= 1 and diff.max() <= 4 and (diff > 1).float().mean() < 0.01


def test_draft_keeps_the_output_resolution():
    big = _photo(2000, 1500)
    seen = []
    real = Image.Image.resize

    def spy(self, size, resample=None, box=None, **kw):
        seen.append((self.size, box))
        return real(self, size, resample, box, **kw)

    Image.Image.resize = spy
    try:
        torch.manual_seed(0)
        FastTrainTransform((224, 224))(big)
    finally:
        Image.Image.resize = real
    ((drafted, box),) = seen
    assert drafted[0] < 2000  # a reduced DCT scale was used...
    assert box[2] - box[0] >= 224 and box[3] - box[1] >= 224  # ...and the crop still has >= 224 px


def test_normalize_on_device_equals_worker_side_float():
    img = Image.open(io.BytesIO(_photo(40, 30)))
    u8 = torch.from_numpy(np.array(img)).permute(2, 0, 1)
    ref = ToNormalizedTensor((0.1, 0.2, 0.3), (0.5, 0.6, 0.7))(img)
    assert torch.equal(normalize_on_device(u8[None], (0.1, 0.2, 0.3), (0.5, 0.6, 0.7))[0], ref)
    bf = normalize_on_device(u8[None], (0.1, 0.2, 0.3), (0.5, 0.6, 0.7), torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf[0], ref.to(torch.bfloat16))


def test_awkward_batch_decoded_or_counted(tmp_path):
    cmyk = _photo(64, 48, mode="CMYK")
    assert Image.open(io.BytesIO(cmyk)).mode == "CMYK"
    samples = [
        _photo(64, 48)[:300] + b"garbage",  # corrupt JPEG
        _photo(64, 48, fmt="PNG"),
        cmyk,
        _photo(1, 1),
        _photo(6000, 4000, quality=50),
        _photo(80, 60),
    ]
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for i, data in enumerate(samples):
            _add(tar, f"{i:06d}.{'png' if i == 1 else 'jpg'}", data)
            _add(tar, f"{i:06d}.txt", f"sample {i}".encode())
    # the size limits off (--min-image-size / --max-image-size 0): the point is that the decode path takes
    # the 1x1 and 6000x4000 images; the limits have their own tests (test_data_wds.py)
    cfg = DataConfig(
        train_data=str(tmp_path / "s.tar"), train_num_samples=6, workers=0, data_decode="cpu",
        min_image_size=0, max_image_size=0,
    )  # fmt: skip
    td = build_train_data(cfg, tokenizer=IdTokenizer(), image_size=32, batch_size=6, rank=0, world_size=1, seed=0)
    try:
        ((images, tokens),) = list(td.batches(0))
    finally:
        td.close()
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float32 and torch.isfinite(images).all()
    ids = tokens[:, 0].tolist()
    assert set(ids) >= {1, 2, 3, 4, 5} and ids.count(0) == 0  # the corrupt row reuses a good sample
    assert td.stats().get("corrupt_image") == 1  # only the corrupt JPEG; PNG, CMYK, 1x1, 6000x4000 decoded


def test_gpu_decode_without_cuda_is_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="use --data-decode cpu"):
        DataConfig(train_data="x.tar", data_decode="gpu").check()


def test_pil_mode_and_unsupported_aug_keep_the_float_path():
    assert fast_train_transform(224, {"use_timm": True}) is None
    assert fast_train_transform(224, {"scale": (0.5, 1.0)}).scale == (0.5, 1.0)
