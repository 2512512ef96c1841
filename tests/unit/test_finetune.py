"""Fine-tuning pieces in one process: position-embedding resampling on load, --pretrained resolution
errors, ImageNet class names for WordNet-id folders, --imagenet-val, the HF tokenizer export."""

from __future__ import annotations

import sys

import pytest
import torch

from dsclip.checkpoint.pretrained import load_pretrained_into, resolve_pretrained
from dsclip.config import ConfigError, make_run_config
from dsclip.eval.datasets import ClassFolderDataset, imagenet_classnames
from dsclip.model import create_model, export_openclip, save_model


def _img(path):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (10, 20, 30)).save(path)


@pytest.mark.parametrize("layout", ["dsclip", "openclip"])
def test_pretrained_of_another_size_is_resampled_with_timm(tmp_path, layout):
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    small = create_model("tiny")  # 32 px, patch 8: 4x4 grid
    if layout == "dsclip":
        save_model(small, tmp_path)
    else:
        export_openclip(small.state_dict(), small.config, tmp_path)
    cfg = create_model("tiny", device="meta").config
    cfg["vision_cfg"]["image_size"] = 48  # 6x6 grid
    big = create_model(cfg)
    load_pretrained_into(big, tmp_path)
    want = resample_abs_pos_embed(small.visual.pos_embed.detach(), new_size=[6, 6], num_prefix_tokens=1)
    torch.testing.assert_close(big.visual.pos_embed.detach(), want, atol=1e-6, rtol=0)
    assert torch.equal(big.visual.pos_embed[:, 0], small.visual.pos_embed[:, 0])  # class token position kept
    for (n, a), (_, b) in zip(small.state_dict().items(), big.state_dict().items()):
        if n != "visual.pos_embed":
            assert torch.equal(a, b), n
    images = torch.randn(2, 3, 48, 48)
    assert big.eval().encode_image(images).shape == (2, 32)


def test_pretrained_without_open_clip_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip -> ImportError
    with pytest.raises(ConfigError, match=r"needs OpenCLIP's registry: pip install 'dsclip\[openclip\]'"):
        resolve_pretrained("ViT-B-32", "laion2b_s34b_b79k")
    with pytest.raises(FileNotFoundError):  # looks like a path: a missing file, not a tag
        resolve_pretrained("ViT-B-32", "weights/epoch_3.pt")


def test_open_clip_spec_needs_model_and_tag():
    pytest.importorskip("open_clip")
    with pytest.raises(ConfigError, match="expected open_clip:MODEL/TAG"):
        resolve_pretrained("demo", "open_clip:ViT-B-32")
    with pytest.raises(ConfigError, match="OpenCLIP has no pretrained weights for 'tiny'"):
        resolve_pretrained("tiny", "laion2b_s34b_b79k")


def test_export_folder_brings_its_architecture_and_tokenizer(tmp_path):
    m = create_model("tiny")
    save_model(m, tmp_path / "ds")
    (tmp_path / "ds" / "tokenizer.model").write_bytes(b"x")
    r = resolve_pretrained("demo", str(tmp_path / "ds"))
    assert r.model_cfg == m.config and r.tokenizer == str(tmp_path / "ds" / "tokenizer.model")
    export_openclip(m.state_dict(), m.config, tmp_path / "oc")
    r = resolve_pretrained("demo", str(tmp_path / "oc"))
    assert r.model_cfg["vision_cfg"]["image_size"] == 32 and r.tokenizer == f"open_clip:local-dir:{tmp_path / 'oc'}"


def test_imagenet_wnid_folders_get_builtin_names_in_folder_order(tmp_path):
    names = imagenet_classnames()
    assert len(names) == 1000 and list(names) == sorted(names)  # ImageNet label order = sorted WordNet ids
    assert names["n01440764"] == "tench" and names["n15075141"] == "toilet paper"
    for wnid in ("n04592741", "n01440764", "n02123045"):  # wing, tench, tabby cat
        _img(tmp_path / wnid / "ILSVRC2012_val_00000001.JPEG")
    ds = ClassFolderDataset(tmp_path, transform=lambda x: x)
    assert ds.classnames == ["tench", "tabby cat", "airplane wing"]  # OpenCLIP's names
    assert ds.labels == [0, 1, 2]


@pytest.mark.parametrize(
    "folders, what", [(["n01440764", "n99999999"], "not an ImageNet-1k class"), (["0", "1"], "not a readable name")]
)
def test_unknown_class_folders_ask_for_classnames_txt(tmp_path, folders, what):
    for f in folders:
        _img(tmp_path / f / "a.png")
    with pytest.raises(ValueError, match=f"is {what}; write .*classnames.txt with one class name per line") as e:
        ClassFolderDataset(tmp_path, transform=lambda x: x)
    assert "\n" not in str(e.value)
    (tmp_path / "classnames.txt").write_text("fish\nother\n")
    assert ClassFolderDataset(tmp_path, transform=lambda x: x).classnames == ["fish", "other"]


def test_imagenet_val_flag_is_zeroshot_data():
    cfg = make_run_config({"imagenet_val": "/data/imagenet/val", "name": "x"})
    assert cfg.data.zeroshot_data == "/data/imagenet/val"
    with pytest.raises(ConfigError, match="either --imagenet-val or --zeroshot-data"):
        make_run_config({"imagenet_val": "/a", "zeroshot_data": "/b", "name": "x"})


def test_lock_flags_are_run_settings():
    cfg = make_run_config({"lock_image": True, "lock_text_unlocked_layers": 2, "lock_text": True, "name": "x"})
    assert cfg.lock.lock_image and cfg.lock.lock_text_unlocked_layers == 2


def test_openclip_file_with_openclip_vocabulary_gets_openclip_tokenizer(tmp_path):
    bpe = create_model("tiny", vocab_size=49408)
    export_openclip(bpe.state_dict(), bpe.config, tmp_path / "bpe")
    assert (
        resolve_pretrained("tiny", str(tmp_path / "bpe" / "open_clip_model.safetensors")).tokenizer == "open_clip:tiny"
    )
    own = create_model("tiny", vocab_size=300)
    export_openclip(own.state_dict(), own.config, tmp_path / "own")
    assert resolve_pretrained("tiny", str(tmp_path / "own" / "open_clip_model.safetensors")).tokenizer is None
