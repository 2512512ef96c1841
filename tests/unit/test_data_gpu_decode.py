"""The GPU input path (dsclip.data.gpu_decode), run on CPU: the same decode and transform functions
with ``device="cpu"`` (``torchvision.io.decode_jpeg`` on CPU tensors, libjpeg-turbo, where a CUDA
run gets nvJPEG). What only CUDA has -- the side stream of the prefetch and, in one test, the nvJPEG
call failing on the device -- is mocked, and each test says so. A TrainData built with
``data_decode="gpu"`` on this CPU-only machine runs the GPU path on CPU: ``build_train_data`` does not
ask for CUDA (``DataConfig.check`` does, for the command line) and the device is CPU until
``set_device``."""

import io
import tarfile
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import dsclip.data.loader as loader_mod
from dsclip.data import DataConfig, build_train_data
from dsclip.data import gpu_decode as gd
from dsclip.data.device_transform import SideStream, normalize_on_device
from dsclip.data.fast_transforms import FastTrainTransform
from dsclip.data.transforms import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from dsclip.train.metrics import data_counters
from tests.unit.test_data_wds import IdTokenizer, _add, make_shards
from tests.unit.test_fast_input import _photo


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _gpu_path_crop(data: bytes, size, seed: int) -> torch.Tensor:
    """The GPU path end to end on CPU: the worker's header read + box, the batch, the device decode."""
    torch.manual_seed(seed)
    sample = gd.EncodedTrainTransform(size)(data)
    assert sample.data is not None and sample.image is None  # shipped encoded
    out, _, counts = gd.decode_batch(gd.EncodedBatch.collate([sample]), torch.zeros(1, 2), size, "cpu")
    assert not counts
    return out[0]


def _corrupt_after_header(data: bytes) -> bytes:
    """A JPEG whose header reads (PIL opens it, so the worker ships it) but whose scan is cut off."""
    bad = data[: int(len(data) * 0.6)] + b"garbage"
    assert Image.open(io.BytesIO(bad)).size  # the header is fine
    return bad


def test_crop_equals_the_cpu_paths_crop_for_the_same_box():
    """Same seed -> same box (crop_params under the per-batch RNG); the pixels then differ only by how
    each library rounds bicubic. Derived tolerance: PIL resamples uint8 with fixed-point weights and
    torchvision in float, each rounding once at the end: at most 1 level apart wherever both filters
    read the same pixels. A crop's outer 2 output pixels differ a little more: PIL's resize(box=) lets
    the filter read the real pixels just outside the box, torchvision crops first and clamps at its
    edge (the same border the CPU path's own draft-off test bounds by 4 levels). Where the two round
    differently the difference is +-1 either way: no bias, so the mean signed difference stays near 0
    (the share of off-by-one pixels itself depends on the scale: up to a quarter of them at 300->224)."""
    photos = [_photo(400, 300), _photo(300, 500, seed=1), _photo(640, 480, seed=2, mode="L")]
    photos.append(_encode(Image.open(io.BytesIO(photos[0])), progressive=True))  # nvJPEG decodes progressive
    for data in photos:
        for size in ((64, 64), (224, 224), (32, 48)):
            for seed in range(3):
                got = _gpu_path_crop(data, size, seed).int()
                torch.manual_seed(seed)
                ref = FastTrainTransform(size, draft=False)(data).int()  # full decode: the pixels nvJPEG sees
                assert got.shape == ref.shape == (3, *size)
                d = (got - ref).abs()
                assert d[:, 2:-2, 2:-2].max() <= 1 and d.max() <= 4, (size, seed, d.max())
                assert (d > 1).float().mean() < 0.01  # only at the border: not a shifted or different crop
                assert abs((got - ref).float().mean()) < 0.02  # rounding, not a colour or level shift
    # the full-image box (no border effect) is within one level everywhere
    data = _photo(400, 300)
    torch.manual_seed(0)
    assert gd.EncodedTrainTransform((64, 64))(data).box == (0, 0, 300, 400)
    d = _gpu_path_crop(data, (64, 64), 0).int() - _seeded(FastTrainTransform((64, 64), draft=False), data, 0).int()
    assert d.abs().max() <= 1


def _seeded(fn, data, seed):
    torch.manual_seed(seed)
    return fn(data)


def _encode(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def test_worker_ships_jpegs_encoded_and_decodes_the_rest_with_the_cpu_path():
    t = gd.EncodedTrainTransform((32, 32))
    for data in (_photo(64, 48), _photo(64, 48, mode="L")):
        assert _seeded(t, data, 0).data == data
    webp = io.BytesIO()
    Image.open(io.BytesIO(_photo(64, 48))).save(webp, format="WEBP")
    for data in (_photo(64, 48, fmt="PNG"), _photo(64, 48, mode="CMYK"), webp.getvalue()):
        s = _seeded(t, data, 3)
        assert s.data is None and s.image.dtype == torch.uint8
        assert torch.equal(s.image, _seeded(FastTrainTransform((32, 32)), data, 3))  # the CPU path's crop
    # and both kinds draw one box from the RNG: the rows after a fallback row keep their crops
    jpg, png = _photo(64, 48, seed=5), _photo(64, 48, fmt="PNG")
    torch.manual_seed(1)
    a = [t(jpg).box, t(jpg).box]
    torch.manual_seed(1)
    t(png)
    assert t(jpg).box == a[1]


def _awkward_shard(path):
    big = _photo(6000, 4000, quality=50)
    samples = [
        _corrupt_after_header(_photo(200, 150)),  # reaches the device decode, fails there and on CPU
        _photo(64, 48)[:300] + b"garbage",  # header cut off: the worker skips it, as today
        _photo(64, 48, fmt="PNG"),
        _photo(64, 48, mode="CMYK"),
        _photo(1, 1),
        big,
        _photo(80, 60),
    ]
    with tarfile.open(path, "w") as tar:
        for i, data in enumerate(samples):
            _add(tar, f"{i:06d}.{'png' if i == 2 else 'jpg'}", data)
            _add(tar, f"{i:06d}.txt", f"sample {i}".encode())
    return len(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_awkward_batch_decoded_or_skipped_and_counted(tmp_path, workers):
    """A corrupt JPEG (two kinds), a PNG, a CMYK JPEG, a 1x1 and a 6000x4000 image in one batch on the GPU
    path (on CPU): each is decoded (on the device, or on the CPU as the fallback) or skipped and counted,
    the batch keeps its rows, nothing crashes. workers=1 also sends the encoded batch through the
    DataLoader's worker queue."""
    n = _awkward_shard(tmp_path / "s.tar")
    cfg = DataConfig(
        train_data=str(tmp_path / "s.tar"), train_num_samples=n, workers=workers, data_decode="gpu",
        min_image_size=0, max_image_size=0, shuffle_buffer=0,
    )  # fmt: skip
    td = build_train_data(cfg, tokenizer=IdTokenizer(), image_size=32, batch_size=n, rank=0, world_size=1, seed=0)
    assert isinstance(td.device_prep, gd.GpuDecodePrep)
    try:
        ((images, tokens),) = list(td.batches(0))
    finally:
        td.close()
    assert images.shape == (n, 3, 32, 32) and images.dtype == torch.float32 and torch.isfinite(images).all()
    ids = tokens[:, 0].tolist()
    assert ids[2:] == [2, 3, 4, 5, 6]  # PNG, CMYK, 1x1, 6000x4000, good: each trained on in its own row
    assert ids[0] in ids[2:] and ids[1] in ids[2:]  # the corrupt rows took other rows of the batch...
    assert torch.equal(images[0], images[ids.index(ids[0], 2)])  # ...image and caption together
    stats = td.stats()
    assert stats["corrupt_image"] == 2 and stats[gd.CPU_DECODED] == 2, stats  # PNG + CMYK on the CPU
    logged = data_counters(stats)
    assert logged["bad_samples"] == 2 and logged["cpu_decoded_images"] == 2  # fallbacks are not bad samples


def test_device_failure_falls_back_to_cpu_then_drops(monkeypatch):
    """nvJPEG failing on the device is mocked (the call on a non-CPU device raises for the marked
    sample, as nvJPEG does for a stream it does not support); the ``meta`` device stands in for CUDA.
    The batched call fails -> each sample alone -> the marked one is decoded on CPU and moved; a corrupt
    one fails on CPU too and is None."""
    real = gd._decode
    calls = []
    good, marked = _u8(_photo(64, 48)), _u8(_photo(70, 50, seed=3))
    bad = _u8(_corrupt_after_header(_photo(80, 60)))

    def nvjpeg(data, device):
        calls.append((len(data), device.type))
        if device.type == "cpu":
            return real(data, device)
        if any(d is marked for d in data):
            raise RuntimeError("Error while decoding JPEG images: nvjpeg status 4 (mocked)")
        return [torch.empty(real([d], torch.device("cpu"))[0].shape, dtype=torch.uint8, device=device) for d in data]

    monkeypatch.setattr(gd, "_decode", nvjpeg)
    images, counts = gd.decode_jpegs([good, marked, bad], "meta")
    assert calls[0] == (3, "meta")  # one batched call first
    assert [None if i is None else (i.device.type, tuple(i.shape)) for i in images] == [
        ("meta", (3, 48, 64)), ("meta", (3, 50, 70)), None,
    ]  # fmt: skip
    assert counts == {gd.CPU_DECODED: 1, gd.CORRUPT: 1}


class _FakeStream:
    """Stands in for torch.cuda.Stream (mocked: this machine has no CUDA)."""

    def __init__(self, device=None, events=None, name="side"):
        self.device, self.events, self.name = device, events, name

    def wait_stream(self, other):
        self.events.append(("wait", self.name, other.name))


def test_prefetch_with_a_mocked_cuda_stream_keeps_order_and_content(tmp_path, monkeypatch):
    """The CUDA API is mocked (torch.cuda.Stream / stream / current_stream / set_device and
    Tensor.record_stream record what they are asked); the batches are the GPU path's, made on CPU.
    With a (mocked) CUDA stream the read-ahead runs in its own thread: batch n+1 is prepared there,
    inside the side stream's context, after batch n was handed over (the step's stream waits for the
    side stream, the images are recorded on the step's stream). The batches equal, in order, those of
    a run without the stream; stopping early gives the read-ahead batch back, so the next read
    continues at the consumer's position."""
    pattern = make_shards(tmp_path / "d", 2, 12)  # jpg, png and webp: encoded and worker-decoded rows

    def build():
        cfg = DataConfig(train_data=pattern, workers=0, shuffle_buffer=8, data_decode="gpu")
        return build_train_data(cfg, tokenizer=IdTokenizer(), image_size=16, batch_size=4, rank=0, world_size=1,
                                seed=3)  # fmt: skip

    plain = build()
    ref = [(i.clone(), t.clone()) for i, t in plain.batches(0)]
    plain.close()
    assert len(ref) == 6

    events, threads, devices = [], set(), []
    main = _FakeStream(events=events, name="main")

    class _Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            threads.add(threading.current_thread().name)
            events.append(("enter", self.s.name))

        def __exit__(self, *exc):
            events.append(("exit", self.s.name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream(device, events))
    monkeypatch.setattr(torch.cuda, "stream", _Ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append(str(d)))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: events.append(("record", s.name, t.shape[0])))
    monkeypatch.setattr(loader_mod, "SideStream", lambda device: SideStream("cuda"))  # a "CUDA" device

    td = build()
    got = []
    try:
        for n, (images, tokens) in enumerate(td.batches(0)):
            events.append(("got", n))
            got.append((images, tokens))
            if n == 2:
                break  # stop early: batch 3 was read ahead
        assert _same(got, ref[:3])
        assert threads == {"dsclip-prep_0"} and devices == ["cuda"]  # not the consumer's thread; bound to its GPU
        prepared, handed = [("enter", "side"), ("exit", "side")], [("wait", "main", "side"), ("record", "main", 4)]
        # the read-ahead thread and the consumer interleave only where the order does not matter
        assert [e for e in events if e[0] != "got"] == prepared + (handed + prepared) * 3
        for n in range(3):  # batch n reaches the consumer after it was handed over
            assert events.index(("got", n)) > [i for i, e in enumerate(events) if e[0] == "record"][n]
        rest = [(i.clone(), t.clone()) for i, t in td.batches(0, 3)]  # continues where the consumer stopped
        assert _same(rest, ref[3:])
        assert events[-2:] == handed  # the last batch: nothing read ahead
    finally:
        td.close()


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_gpu_prep_normalises_like_the_cpu_path():
    data = _photo(90, 70)
    torch.manual_seed(0)
    batch = gd.EncodedBatch.collate([gd.EncodedTrainTransform((32, 32))(data)])
    prep = gd.GpuDecodePrep((32, 32), OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)
    prep.dtype = torch.bfloat16
    x, _, _ = prep.prepare(batch, torch.zeros(1, 2))
    u8, _, _ = gd.decode_batch(batch, torch.zeros(1, 2), (32, 32), "cpu")
    assert x.dtype == torch.bfloat16
    assert torch.equal(x, normalize_on_device(u8, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, torch.bfloat16))
    assert np.isfinite(x.float().numpy()).all()


def _photo_shards(root, n_shards=2, per_shard=10):
    """Textured photos (a crop changes the pixels, unlike a solid colour), JPEG with a PNG and a CMYK
    JPEG among them; 40-47 px so that the CPU path decodes them at full scale (no draft) as nvJPEG does."""
    root.mkdir()
    i = 0
    for k in range(n_shards):
        with tarfile.open(root / f"p-{k}.tar", "w") as tar:
            for _ in range(per_shard):
                fmt, mode = ("PNG", "RGB") if i % 7 == 3 else ("JPEG", "CMYK" if i == 5 else "RGB")
                data = _photo(40 + i % 8, 40, seed=i, fmt=fmt, mode=mode)
                _add(tar, f"{i:06d}.{'png' if fmt == 'PNG' else 'jpg'}", data)
                _add(tar, f"{i:06d}.txt", f"sample {i}".encode())
                i += 1
    return str(root / f"p-{{0..{n_shards - 1}}}.tar")


@pytest.mark.parametrize("workers", [0, 2])
def test_gpu_path_resumed_after_a_kill_sees_the_same_crops(tmp_path, workers):
    """The device-transform path run on CPU: a run killed mid-epoch and started again at that step
    (a fresh TrainData, fresh workers) gets exactly the batches -- crops included -- of the run that was
    not killed; and those crops are the CPU path's (the same boxes from the same per-sample RNG)."""
    pattern = _photo_shards(tmp_path / "d")

    def build(decode):
        cfg = DataConfig(train_data=pattern, train_num_samples=20, workers=workers, shuffle_buffer=6,
                         data_decode=decode)  # fmt: skip
        return build_train_data(cfg, tokenizer=IdTokenizer(), image_size=32, batch_size=4, rank=0, world_size=1,
                                seed=11)  # fmt: skip

    def read(td, start=0, stop=None):
        out = []
        try:
            for n, (images, tokens) in enumerate(td.batches(0, start)):
                out.append((images.clone(), tokens.clone()))
                if stop is not None and n + 1 == stop:
                    break
        finally:
            td.close()
        return out

    full = read(build("gpu"))
    assert len(full) == 5
    killed = read(build("gpu"), stop=2)  # steps 0 and 1 trained, then the process dies
    assert _same(killed, full[:2])
    assert _same(read(build("gpu"), start=2), full[2:])  # resumed at step 2: the same crops
    cpu = read(build("cpu"))
    std = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    for (g, gt), (c, ct) in zip(full, cpu):
        assert torch.equal(gt, ct)  # the same samples in the same rows
        levels = ((g - c).abs() * std * 255).round()  # back to uint8 steps
        assert levels.max() <= 4 and levels.mean() < 0.3  # the same crops, up to bicubic rounding (see above)
    # and the crops are drawn, not fixed: epoch 1 crops the same samples differently
    td = build("gpu")
    try:
        again = [(i.clone(), t.clone()) for i, t in td.batches(1)]
    finally:
        td.close()

    def by_id(batches):
        return {int(t[0]): img for images, tokens in batches for img, t in zip(images, tokens)}

    e0, e1 = by_id(full), by_id(again)
    common = e0.keys() & e1.keys()  # (with 2 workers a slot's share is short: some samples repeat)
    assert len(common) >= 12 and sum(not torch.equal(e0[k], e1[k]) for k in common) >= len(common) - 2


def test_fallback_is_one_notice_and_a_counter_in_the_step_lines(tmp_path, capsys):
    """Non-JPEG shards on the GPU path: one line in the log saying the images took the CPU and how many,
    then the count in each step line (cpu_decoded_images), and not as bad samples."""
    from dsclip.train.gradcache import StepResult
    from dsclip.train.metrics import MetricsLogger

    result = StepResult(loss=1.0, logit_scale=1.0, logit_bias=None, grad_norm=None, applied=True)
    m = MetricsLogger(tmp_path, rank=0, world_size=1, every_n_steps=1, report_to="", samples_per_step=8,
                      total_steps=10, device=torch.device("cpu"))  # fmt: skip
    for step, n in ((1, 0), (2, 3), (3, 11)):
        m.step(step, result, data_wait_s=0, lr=1, epoch=0, extra=data_counters({gd.CPU_DECODED: n}))
    m.close()
    out = capsys.readouterr().out
    assert out.count("note: ") == 1 and "note: 3 images so far on rank 0 are not JPEGs nvJPEG decodes" in out
    assert "cpu_decoded_images 11" in out and "bad_samples" not in out


def test_auto_is_the_gpu_path_only_where_cuda_is_present(monkeypatch):
    """``--data-decode auto``: the CPU path on this machine; with CUDA reported present (mocked) the GPU
    path; ``--aug-cfg`` that needs PIL keeps the PIL transform on either."""
    from dsclip.data.webdataset import train_transform

    cfg = DataConfig(train_data="x.tar")
    assert type(train_transform(cfg, 224)) is FastTrainTransform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    t = train_transform(DataConfig(train_data="x.tar", aug_cfg={"scale": (0.5, 1.0)}), 224)
    assert isinstance(t, gd.EncodedTrainTransform) and t.scale == (0.5, 1.0) and t.size == (224, 224)
    assert not getattr(train_transform(DataConfig(train_data="x.tar", aug_cfg={"use_timm": True}), 224),
                       "takes_bytes", False)  # fmt: skip
    assert type(train_transform(DataConfig(train_data="x.tar", data_decode="cpu"), 224)) is FastTrainTransform
