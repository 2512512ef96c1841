"""--image-mean/--image-std/--image-interpolation/--image-resize-mode/--aug-cfg: dsclip's transforms give
OpenCLIP's images for the same settings, the training data uses them, and bad values fail early.

Pixel-exact: both transforms run on the same image with torch's and Python's RNGs seeded alike. dsclip
fuses ToTensor + Normalize into one pass (different float rounding), so tensors are compared within
1e-5: the float32 rounding of (x - m) / s at |values| < 3 is a few ulp (< 1e-6), while a pixel that
differs by one level moves its value by 1 / (255 * std) > 0.0137 -- any pixel difference fails."""

from __future__ import annotations

import io
import json
import pickle
import random
import re
import tarfile
import warnings
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from dsclip.checkpoint.convert import run_preprocess_cfg
from dsclip.checkpoint.ds_checkpoint import Checkpointer
from dsclip.checkpoint.layout import RUN_CONFIG_FILE
from dsclip.cli import main as cli_main
from dsclip.config import ConfigError, make_run_config, parse_run_config, save_run_config
from dsclip.data import DataConfig, build_train_data
from dsclip.data.demo import DemoDataset
from dsclip.data.loader import mix_seed
from dsclip.data.transforms import image_transform, openclip_preprocess_cfg, parse_aug_cfg, seeded_rngs
from dsclip.eval.cli import _parser as eval_parser
from dsclip.eval.cli import preprocess_for
from dsclip.eval.evaluator import Evaluator
from dsclip.model import create_model
from tests.unit.test_data_wds import IdTokenizer

ATOL = 1e-5  # see the module docstring: ulp-level rounding passes, one pixel level (>= 0.0137) fails


def _image(w=61, h=47, seed=0) -> Image.Image:
    """Non-square, textured (noise on gradients), so crops, resizes and jitter all change pixels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], axis=-1)
    arr = np.clip(base + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def _run(transform, img, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    random.seed(seed)
    return transform(img)


def _assert_same(ours, theirs, img, seeds=range(4), exact=False):
    for s in seeds:
        a, b = _run(ours, img, s), _run(theirs, img, s)
        assert a.shape == b.shape, (a.shape, b.shape)
        if exact:
            assert torch.equal(a, b), f"seed {s}: max diff {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"seed {s}")


EVAL_SETTINGS = [
    {},
    {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.5, 0.75)},
    {"mean": [0.4], "std": [0.3]},  # one value for all channels
    {"interpolation": "bilinear"},
    {"interpolation": "bicubic", "resize_mode": "longest"},
    {"interpolation": "bilinear", "resize_mode": "longest"},
    {"resize_mode": "squash"},
    {"resize_mode": "shortest", "interpolation": "bilinear"},
    {"interpolation": "random", "resize_mode": "squash"},  # 'random' is bicubic outside timm's crop, as OpenCLIP
    {"interpolation": "random", "resize_mode": "longest"},
]


@pytest.mark.parametrize("kw", EVAL_SETTINGS, ids=lambda kw: json.dumps(kw))
@pytest.mark.parametrize("size", [24, 48, (24, 32)])
def test_eval_transform_equals_openclip(kw, size):
    img = _image()
    ours = image_transform(size, is_train=False, **kw)
    theirs = open_clip.image_transform(size, is_train=False, **kw)
    _assert_same(ours, theirs, img, seeds=range(4))  # several seeds: nothing random may leak into eval
    _assert_same(ours, theirs, img.convert("L"), seeds=[0])  # grey input is expanded to RGB by both


TRAIN_SETTINGS = [
    {},
    {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)},
    {"aug_cfg": {"scale": (0.3, 0.6)}},
    {"interpolation": "bilinear", "aug_cfg": {"scale": (0.5, 1.0)}},  # OpenCLIP's plain crop stays bicubic
    {
        "aug_cfg": {
            "scale": (0.4, 0.8),
            "ratio": (0.5, 2.0),  # unused without use_timm, in OpenCLIP too (both warn)
            "color_jitter": (0.4, 0.4, 0.4, 0.1),
            "color_jitter_prob": 0.8,
            "gray_scale_prob": 0.5,
        }
    },
]


@pytest.mark.parametrize("kw", TRAIN_SETTINGS, ids=lambda kw: json.dumps(kw))
def test_train_transform_equals_openclip(kw):
    img = _image()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OpenCLIP's "unused augmentation cfg items" (and ours)
        ours = image_transform(32, is_train=True, **kw)
        theirs = open_clip.image_transform(32, is_train=True, **kw)
    _assert_same(ours, theirs, img, seeds=range(8))


TIMM_SETTINGS = [
    {"aug_cfg": {"use_timm": True}},
    {"aug_cfg": {"use_timm": True, "scale": (0.3, 1.0), "ratio": (0.5, 2.0), "re_prob": 0.9, "re_count": 2}},
    {"interpolation": "bilinear", "aug_cfg": {"use_timm": True, "re_prob": 1.0, "color_jitter": 0.4}},
    {"interpolation": "random", "mean": (0.5,) * 3, "std": (0.5,) * 3, "aug_cfg": {"use_timm": True, "re_prob": 0.5}},
]


@pytest.mark.parametrize("kw", TIMM_SETTINGS, ids=lambda kw: json.dumps(kw))
def test_timm_train_transform_equals_openclip(kw):
    img = _image()
    ours = image_transform(32, is_train=True, **kw)
    theirs = open_clip.image_transform(32, is_train=True, **kw)
    _assert_same(ours, theirs, img, seeds=range(8), exact=True)  # timm's own transform on both sides


def test_settings_change_the_images():
    """The comparisons above would pass vacuously if every setting gave the default image."""
    img = _image()

    def run(is_train, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(image_transform(32, is_train=is_train, **kw), img, 0)

    base_eval, base_train = run(False), run(True)
    for kw in EVAL_SETTINGS[1:]:
        assert not torch.allclose(run(False, **kw), base_eval, atol=1e-3), kw
    for kw in TRAIN_SETTINGS[1:] + TIMM_SETTINGS:
        assert not torch.allclose(run(True, **kw), base_train, atol=1e-3), kw
    erased = run(True, aug_cfg={"use_timm": True, "re_prob": 1.0})
    no_erase = run(True, aug_cfg={"use_timm": True})
    assert not torch.allclose(erased, no_erase, atol=1e-3)


def test_unused_non_timm_keys_warn_like_openclip():
    with pytest.warns(UserWarning, match="ratio, re_prob unused without use_timm=True"):
        image_transform(32, is_train=True, aug_cfg={"ratio": (0.5, 2.0), "re_prob": 0.5})


def _table(tmp_path, n=6):
    (tmp_path / "img").mkdir()
    rows = ["filepath\ttitle"]
    for i in range(n):
        _image(40 + i, 30, seed=i).save(tmp_path / "img" / f"{i}.png")
        rows.append(f"img/{i}.png\tsample {i}")
    (tmp_path / "data.tsv").write_text("\n".join(rows) + "\n")
    return str(tmp_path / "data.tsv")


@pytest.mark.parametrize(
    "flags",
    [
        ["--image-mean", "0.5", "0.5", "0.5", "--image-std", "0.2", "0.3", "0.4"],
        ["--aug-cfg", "scale=(0.3,0.7)", "color_jitter=(0.4,0.4,0.4,0.1)", "color_jitter_prob=1.0"],
        ["--aug-cfg", "use_timm=True", "re_prob=1.0", "scale=(0.5,1.0)", "--image-interpolation", "bilinear"],
    ],
    ids=["mean-std", "jitter", "timm"],
)
def test_csv_training_batches_use_the_flags(tmp_path, flags):
    """A CSV batch equals OpenCLIP's transform, built from the same flags, applied by hand to each image
    under the data path's per-sample seed."""
    path = _table(tmp_path)
    cfg = parse_run_config(["--train-data", path, "--workers", "0", "--name", "x", *flags])
    td = build_train_data(cfg.data, tokenizer=IdTokenizer(), image_size=24, batch_size=3, rank=0, world_size=1, seed=7)
    d = cfg.data
    with warnings.catch_warnings():  # OpenCLIP lists the jitter keys it does use as "unused"
        warnings.simplefilter("ignore")
        oc = open_clip.image_transform(
            24,
            is_train=True,
            mean=d.image_mean,
            std=d.image_std,
            interpolation=d.image_interpolation,
            resize_mode=d.image_resize_mode,
            aug_cfg=dict(d.aug_cfg),
        )
    plain = open_clip.image_transform(24, is_train=True)
    n = 0
    for epoch in (0, 1):
        for images, tokens in td.batches(epoch):
            for row, i in enumerate(tokens[:, 0].tolist()):
                img = Image.open(tmp_path / "img" / f"{i}.png").convert("RGB")
                with seeded_rngs(mix_seed(7, epoch, i)):
                    expected = oc(img)
                with seeded_rngs(mix_seed(7, epoch, i)):
                    default = plain(img)
                torch.testing.assert_close(images[row], expected, rtol=0, atol=ATOL)
                assert not torch.allclose(images[row], default, atol=1e-3)  # the flags changed the image
                n += 1
    assert n == 12


@pytest.mark.parametrize("workers", [0, 1])
def test_webdataset_training_batches_use_the_flags(tmp_path, workers):
    """A webdataset batch (step k of an epoch) equals OpenCLIP's transform applied by hand to its images in
    order, under the batch's seed (torch's and Python's RNGs: timm's crop and erasing draw from both);
    with a worker process too (the transform is pickled into it)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000.tar", "w") as tar:
        for i in range(8):
            buf = io.BytesIO()
            _image(40 + i, 30, seed=i).save(buf, format="PNG")
            for name, data in ((f"{i:06d}.png", buf.getvalue()), (f"{i:06d}.txt", f"sample {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    flags = [
        "--aug-cfg",
        "use_timm=True",
        "re_prob=0.5",
        "scale=(0.4,1.0)",
        "--image-mean",
        "0.5",
        "--image-std",
        "0.3",
    ]
    args = ["--train-data", str(shards / "shard-000.tar"), "--train-num-samples", "8", "--workers", str(workers)]
    cfg = parse_run_config([*args, "--shuffle-buffer", "0", "--name", "x", *flags])
    td = build_train_data(cfg.data, tokenizer=IdTokenizer(), image_size=24, batch_size=4, rank=0, world_size=1, seed=3)
    oc = open_clip.image_transform(24, is_train=True, mean=[0.5], std=[0.3], aug_cfg=dict(cfg.data.aug_cfg))
    try:
        for step, (images, tokens) in enumerate(td.batches(0)):
            with seeded_rngs(mix_seed(3, 0, 0, step, 0xA06)):  # the data path's per-batch seed
                expected = torch.stack([oc(_decoded(shards, i)) for i in tokens[:, 0].tolist()])
            assert torch.equal(images, expected)  # timm's transform on both sides: bit-identical
    finally:
        td.close()
    assert step == 1


def _decoded(shards, i):
    with tarfile.open(shards / "shard-000.tar") as tar:
        return Image.open(io.BytesIO(tar.extractfile(f"{i:06d}.png").read())).convert("RGB")


def test_flags_parse_and_are_saved_with_the_run():
    cfg = parse_run_config(
        [
            "--name",
            "x",
            "--image-mean",
            "0.5",
            "0.4",
            "0.3",
            "--image-std",
            "0.2",
            "--image-interpolation",
            "bilinear",
            "--image-resize-mode",
            "longest",
            "--aug-cfg",
            "scale=(0.5,1.0)",
            "ratio=(0.75,1.33)",
            "use_timm=True",
            "re_prob=0.25",
            "re_count=2",
        ]
    )
    d = cfg.data
    assert d.image_mean == [0.5, 0.4, 0.3] and d.image_std == [0.2]
    assert (d.image_interpolation, d.image_resize_mode) == ("bilinear", "longest")
    assert d.aug_cfg == {"scale": [0.5, 1.0], "ratio": [0.75, 1.33], "use_timm": True, "re_prob": 0.25, "re_count": 2}
    # the run config is plain YAML (tuples became lists) and reads back to the same settings
    saved = cfg.to_dict()
    again = make_run_config({k: v for sec in saved.values() for k, v in sec.items()})
    assert again.data == d
    assert openclip_preprocess_cfg(saved["data"]) == {
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.2, 0.2],
        "interpolation": "bilinear",
        "resize_mode": "longest",
    }
    # a recipe may give aug_cfg as a mapping
    assert make_run_config({"aug_cfg": {"scale": [0.2, 1.0]}}).data.aug_cfg == {"scale": [0.2, 1.0]}
    assert DataConfig().aug_cfg == {} and parse_run_config(["--name", "x", "--aug-cfg"]).data.aug_cfg == {}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--aug-cfg", "scael=(0.5,1.0)"], "--aug-cfg: unknown key 'scael'; OpenCLIP's keys are scale, ratio"),
        (["--aug-cfg", "scale=0.5"], "--aug-cfg scale=0.5: scale takes two numbers"),
        (["--aug-cfg", "scale=(1.0,0.5)"], "scale takes two numbers"),
        (["--aug-cfg", "re_prob=high"], "--aug-cfg re_prob='high': re_prob takes a probability"),
        (["--aug-cfg", "re_count=1.5"], "re_count takes a positive integer"),
        (["--aug-cfg", "use_timm=yes"], "use_timm takes True or False"),
        (["--aug-cfg", "scale"], "--aug-cfg takes key=value pairs"),
        (["--aug-cfg", "color_jitter_prob=0.5"], "color_jitter_prob needs color_jitter with 4 values"),
        (["--image-mean", "0.5", "0.5"], "--image-mean takes 3 values (R G B) or 1 for all channels, got 2"),
        (["--image-std", "0.1", "0.2", "0.3", "0.4"], "--image-std takes 3 values"),
        (["--image-std", "0", "0.2", "0.3"], "--image-std values must be positive"),
        (["--image-mean", "a"], "'image_mean': cannot read"),
    ],
)
def test_bad_values_fail_in_config_validation(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_run_config(["--name", "x", *flags])


def test_bad_aug_cfg_is_one_line_and_exits_nonzero_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["train", "--logs", str(tmp_path / "logs"), "--aug-cfg", "re_count=two"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.splitlines() == [err] and "dsclip train: error: --aug-cfg re_count='two'" in err
    assert not (tmp_path / "logs").exists()  # nothing was started
    rc = cli_main(["train", "--logs", str(tmp_path / "logs"), "--image-mean", "0.5", "0.5"])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2
        and err == "dsclip train: error: --image-mean takes 3 values (R G B) or 1 for all channels, got 2: [0.5, 0.5]"
    )
    rc = cli_main(["train", "--logs", str(tmp_path / "logs"), "--image-interpolation", "nearest"])
    assert rc == 2 and "invalid choice: 'nearest'" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_recipe_aug_cfg_is_checked_too():
    with pytest.raises(ConfigError, match="unknown key 'hflip'"):
        make_run_config({"aug_cfg": {"hflip": 0.5}})
    assert parse_aug_cfg(["color_jitter=0.4"]) == {"color_jitter": 0.4}


class _StateEngine:
    """Writes a ZeRO-0 style checkpoint (module weights in the model-states file), which convert reads
    without DeepSpeed's consolidation: enough to test what convert writes beside the weights."""

    def __init__(self):
        torch.manual_seed(0)
        self.module = create_model("tiny")

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict()}, d / "mp_rank_00_model_states.pt")


def test_convert_carries_the_preprocessing_into_open_clip(tmp_path):
    run = tmp_path / "run"
    flags = ["--image-mean", "0.5", "0.4", "0.3", "--image-std", "0.2", "0.25", "0.3"]
    flags += ["--image-interpolation", "bilinear", "--image-resize-mode", "longest", "--aug-cfg", "scale=(0.5,1.0)"]
    cfg = parse_run_config(["--name", "run", "--logs", str(tmp_path), *flags])
    run.mkdir()
    save_run_config(cfg, run / RUN_CONFIG_FILE)
    Checkpointer(run, every_n_steps=1, every_n_epochs=0, keep_last=0, rank=0).save(_StateEngine(), 1, {"step": 1})
    assert cli_main(["convert", str(run), "--format", "open_clip", "-o", str(tmp_path / "oc")]) == 0
    pre = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert pre["mean"] == [0.5, 0.4, 0.3] and pre["std"] == [0.2, 0.25, 0.3]
    assert (pre["interpolation"], pre["resize_mode"]) == ("bilinear", "longest")
    # OpenCLIP's own loader builds the run's evaluation transform from it
    _, _, oc_val = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    size = pre["size"]
    ours = image_transform(size, is_train=False, **cfg.data.preprocess_args())
    _assert_same(ours, oc_val, _image(), seeds=[0])
    assert not torch.allclose(_run(ours, _image(), 0), _run(image_transform(size, False), _image(), 0), atol=1e-3)

    # dsclip format: config.json carries them too, and dsclip eval evaluates with them (flags override)
    assert cli_main(["convert", str(run), "-o", str(tmp_path / "ds")]) == 0
    for folder in ("ds", "oc"):
        a = eval_parser().parse_args(["--model", str(tmp_path / folder), "--zeroshot-data", "demo"])
        settings = preprocess_for(a)
        assert settings == {k: getattr(cfg.data, k) for k in settings} and len(settings) == 4
        ev = Evaluator(DataConfig(**settings), tokenizer=None, image_size=size)
        _assert_same(ev._transform(), oc_val, _image(), seeds=[0])
    a = eval_parser().parse_args(["--model", str(tmp_path / "ds"), "--image-resize-mode", "squash"])
    assert preprocess_for(a)["image_resize_mode"] == "squash"


def test_eval_cli_refuses_bad_mean_in_one_line(tmp_path, capsys):
    rc = cli_main(["eval", "--model", str(tmp_path), "--zeroshot-data", "demo", "--image-std", "0.2", "0.3"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == "dsclip eval: error: --image-std takes 3 values (R G B) or 1 for all channels, got 2: [0.2, 0.3]"


def test_convert_without_run_config_keeps_openclip_defaults(tmp_path):
    assert run_preprocess_cfg(tmp_path) == {}


@pytest.mark.parametrize("kw", TRAIN_SETTINGS + TIMM_SETTINGS, ids=lambda kw: json.dumps(kw))
def test_transforms_pickle_into_worker_processes(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = image_transform(32, is_train=True, **kw)
    _assert_same(pickle.loads(pickle.dumps(t)), t, _image(), seeds=[0, 1], exact=True)


def test_demo_data_and_its_zeroshot_use_mean_std(monkeypatch):
    """The built-in demo set is rendered at the model size (not augmented) and normalized with the flags."""
    cfg = parse_run_config(["--name", "x", "--image-mean", "0.5", "--image-std", "0.2", "0.25", "0.3"])
    td = build_train_data(cfg.data, tokenizer=IdTokenizer(), image_size=32, batch_size=2, rank=0, world_size=1, seed=0)
    ds = td.dataset  # the DemoDataset the batches are drawn from
    raw = torch.from_numpy(DemoDataset(10, 32, seed=0).render(3)).permute(2, 0, 1).float() / 255
    expected = (raw - 0.5) / torch.tensor([0.2, 0.25, 0.3]).view(3, 1, 1)
    torch.testing.assert_close(ds[3][0], expected, rtol=0, atol=ATOL)
    assert not torch.allclose(DemoDataset(10, 32, seed=0)[3][0], expected, atol=1e-3)  # the defaults differ
    seen = {}

    def fake_zeroshot(model, tokenizer, ds, *args, **kwargs):
        seen["image"] = ds[0][0]
        return {"top1": 0.0, "top5": 0.0}

    monkeypatch.setattr("dsclip.eval.evaluator.evaluate_zeroshot", fake_zeroshot)
    ev = Evaluator(
        DataConfig(zeroshot_data="demo", image_mean=[0.5], image_std=[0.2, 0.25, 0.3]), tokenizer=None, image_size=32
    )
    ev.zeroshot(None)
    raw = torch.from_numpy(DemoDataset.heldout(1, 32).render(0)).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(
        seen["image"], (raw - 0.5) / torch.tensor([0.2, 0.25, 0.3]).view(3, 1, 1), rtol=0, atol=ATOL
    )
