"""A SigLIP architecture through the CLI (issue 32): `dsclip train` at ZeRO-3 with activation checkpointing
(each timm Block of the timm image tower one leaf), `dsclip convert` in both formats, OpenCLIP loading the
export by itself and embedding as dsclip does, and `--pretrained` of an OpenCLIP-layout file."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch

from tests.e2e.test_train_cli import PY, ROOT, env
from tests.unit.test_timm_towers import TINY_SIGLIP

open_clip = pytest.importorskip("open_clip")


def test_siglip_trains_at_zero3_converts_and_openclip_loads_it(tmp_path):
    from dsclip.checkpoint.convert import main_convert
    from dsclip.checkpoint.pretrained import load_pretrained_into
    from dsclip.config_base import ConfigError
    from dsclip.model import create_model, load_model

    cfg = copy.deepcopy(TINY_SIGLIP)
    cfg["text_cfg"].update(vocab_size=1000, context_length=32)
    (tmp_path / "siglip.json").write_text(json.dumps(cfg))
    cmd = [PY, "-m", "dsclip", "train", "--config", "tiny", "--model", str(tmp_path / "siglip.json"), "--siglip",
           "--dataset-type", "synthetic", "--train-num-samples", "32", "--max-steps", "2", "--logs", str(tmp_path),
           "--name", "s", "--deepspeed-config", "ds_configs/zero3.json", "--grad-checkpointing"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loss siglip" in p.stdout and "ZeRO-3" in p.stdout

    ckpt = tmp_path / "s" / "checkpoints"
    assert main_convert([str(ckpt), "-o", str(tmp_path / "ds")]) == 0
    assert main_convert([str(ckpt), "--format", "open_clip", "-o", str(tmp_path / "oc")]) == 0
    # transformers' SiglipModel has no class token (vit_tiny_patch16_224 keeps timm's): refused in one line
    with pytest.raises(ConfigError, match=r"^--format hf: transformers' SiglipModel .*an image class token"):
        main_convert([str(ckpt), "--format", "hf", "-o", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    ours = load_model(tmp_path / "ds").eval()
    assert ours.config["vision_cfg"]["timm_model_name"] == "vit_tiny_patch16_224" and ours.config["custom_text"]
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    oc.eval()
    image = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    vocab = ours.config["text_cfg"]["vocab_size"]  # the run's tokenizer sets it
    text = torch.randint(1, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32: the same timm modules (image); MHA against fused SDPA (text), rounding of two fp32 layers
        torch.testing.assert_close(oc.encode_image(image), ours.visual(image), rtol=0, atol=1e-6)
        torch.testing.assert_close(oc.encode_text(text), ours.text(text), rtol=0, atol=1e-5)
        assert float(oc.logit_bias) == pytest.approx(float(ours.logit_bias))

    # --pretrained of the OpenCLIP-layout file (visual.trunk.*, text.*) into a fresh dsclip model
    fresh = create_model(ours.config).eval()
    load_pretrained_into(fresh, tmp_path / "oc" / "open_clip_model.safetensors")
    for name, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
