"""``dsclip convert --format hf`` (dsclip.checkpoint.hf_export) against transformers itself: the exported folder loads
with ``CLIPModel``/``SiglipModel`` and ``CLIPProcessor``/``AutoProcessor``, and embeds, scales and tokenizes as dsclip.

Tolerance: the same fp32 weights through two implementations (transformers' separate q/k/v projections and its
attention against timm's fused qkv and SDPA) differ only in the order of the forward pass's chained sums:
``tests.tolerances.embedding_tol`` (rounding over ``forward_terms`` of the config, unit-size embeddings). Logits
add a D-term dot product of unit vectors times the scale. The logit scale itself is the same float through the
same ``exp``: equal exactly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dsclip.checkpoint.hf_export import TokenizerSource, export_state_dict
from dsclip.config_base import ConfigError
from dsclip.model import create_model
from tests.tolerances import embedding_tol, worst_case

transformers = pytest.importorskip("transformers")

CAPTIONS = [
    "a photo of a red circle.",
    "a star",
    "there is a small cross on the left. it is blue.",
    "  Extra   spaces and UPPER case  ",
    "a " + "long " * 60 + "caption",  # cut at the context length: EOS kept in the last position
]


def _demo_tokenizer(context_length: int):
    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(ensure_demo_tokenizer(Path.home() / ".cache" / "dsclip"), context_length)


def _perturbed(model):
    """Move every weight off its init (zero biases, unit norms) so a tensor mapped to the wrong place shows."""
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def _assert_same_outputs(ours, hf_out, images, tokens, cfg):
    tol = embedding_tol(cfg)
    with torch.no_grad():
        ref = ours(image=images, text=tokens)
    torch.testing.assert_close(hf_out.image_embeds, ref["image_features"], rtol=0, atol=tol)
    torch.testing.assert_close(hf_out.text_embeds, ref["text_features"], rtol=0, atol=tol)
    scale = ref["logit_scale"]
    logits = scale * ref["image_features"] @ ref["text_features"].T
    if ref["logit_bias"] is not None:
        logits = logits + ref["logit_bias"]
    # each logit: scale * (a D-term dot product of two unit vectors, each off by up to tol per entry)
    d = cfg["embed_dim"]
    logit_tol = float(scale) * (2 * d**0.5 * tol + worst_case(d, 1.0)) + worst_case(2, float(scale) + 10)
    torch.testing.assert_close(hf_out.logits_per_image, logits, rtol=0, atol=logit_tol)


def test_demo_model_embeds_and_tokenizes_in_transformers_as_in_dsclip(tmp_path, capsys):
    from PIL import Image

    from dsclip.data.demo import DemoDataset

    tok = _demo_tokenizer(16)
    ours = _perturbed(create_model("demo", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id))
    with torch.no_grad():
        ours.logit_scale.fill_(5.0)  # above ln(100): dsclip's forward clamps it, the export writes the clamped value
    export_state_dict(
        ours.state_dict(), ours.config, tmp_path, tokenizer=TokenizerSource("spm", path=Path(tok.model_path))
    )
    assert "token ids 2 (EOS) and 1 exchanged" in capsys.readouterr().out
    hf = transformers.CLIPModel.from_pretrained(tmp_path).eval()
    processor = transformers.CLIPProcessor.from_pretrained(tmp_path)

    # the tokenizer: dsclip's ids with EOS (2) and UNK (1) exchanged (transformers' CLIP reads eos_token_id 2 as
    # argmax pooling; the export renumbers both the embedding rows and the tokenizer), padding with 0 as dsclip
    ids = tok(CAPTIONS)
    swapped = ids.clone()
    swapped[ids == 2], swapped[ids == 1] = 1, 2
    got = processor(text=CAPTIONS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    assert torch.equal(got["input_ids"], swapped)
    assert hf.config.text_config.eos_token_id == 1

    # the image processor: dsclip's eval preprocessing of the demo images (32 px, OpenAI mean/std)
    demo = DemoDataset.heldout(3, image_size=32)
    pixels = processor(images=[Image.fromarray(demo.render(i)) for i in range(3)], return_tensors="pt")["pixel_values"]
    # (x/255 - mean)/std two ways: a few roundings of values up to 1/std ~ 4
    torch.testing.assert_close(pixels, torch.stack([demo[i][0] for i in range(3)]), rtol=0, atol=worst_case(4, 4.0))

    with torch.no_grad():
        out = hf(input_ids=got["input_ids"], attention_mask=got["attention_mask"], pixel_values=pixels)
    _assert_same_outputs(ours, out, pixels, ids, ours.config)
    assert (
        float(hf.logit_scale.exp().detach()) == float(ours(image=None)["logit_scale"].detach()) == pytest.approx(100.0)
    )


def test_vit_b_32_shaped_model_with_openclip_bpe_tokenizer(tmp_path):
    """ViT-B-32's widths, patches, vocabulary and context (2 layers per tower: the shapes, not the depth, are what
    the key map must get right) with OpenCLIP's BPE tokenizer as CLIPTokenizer."""
    from dsclip.data.openclip_tokenizer import OpenCLIPTokenizer

    ours = _perturbed(_vit_b_32_2_layers())
    export_state_dict(ours.state_dict(), ours.config, tmp_path, tokenizer=TokenizerSource("openclip_bpe"))
    hf = transformers.CLIPModel.from_pretrained(tmp_path).eval()
    processor = transformers.CLIPProcessor.from_pretrained(tmp_path)
    assert type(processor.tokenizer).__name__ == "CLIPTokenizer"
    assert hf.config.vision_config.hidden_act == hf.config.text_config.hidden_act == "gelu"

    # OpenCLIP's SimpleTokenizer vs CLIPTokenizer: the same ids through the end-of-text token (49407), truncation
    # included; after it OpenCLIP pads with 0 and CLIPTokenizer with <|endoftext|> (OpenAI's files): argmax pooling
    # reads the first 49407 either way, and the causal mask keeps the padding out of every earlier position.
    # (OpenCLIP also runs ftfy and HTML unescaping first; these captions have nothing for them to change.)
    ids = OpenCLIPTokenizer("open_clip:ViT-B-32", 77)(CAPTIONS)
    got = processor(text=CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    real = got["attention_mask"].bool()
    assert torch.equal(got["input_ids"][real], ids[real]) and (ids[~real] == 0).all()
    assert (got["input_ids"][~real] == 49407).all() and torch.equal(real, ids != 0)

    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(**got, pixel_values=images)
    _assert_same_outputs(ours, out, images, ids, ours.config)


def _vit_b_32_2_layers():
    from dsclip.model import get_model_config

    cfg = copy.deepcopy(get_model_config("ViT-B-32"))
    cfg["vision_cfg"]["layers"] = cfg["text_cfg"]["layers"] = 2
    torch.manual_seed(0)
    return create_model(cfg)


SIGLIP_B32 = {
    "embed_dim": 768,
    "init_logit_bias": -10,
    "custom_text": True,
    "vision_cfg": {"image_size": 256, "timm_model_name": "vit_base_patch32_siglip_256", "timm_pool": "map",
                   "timm_proj": "none"},
    "text_cfg": {"context_length": 16, "width": 64, "heads": 4, "layers": 2, "no_causal_mask": True,
                 "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6},
                 "act_kwargs": {"approximate": "tanh"}},
}  # fmt: skip


def test_siglip_vit_embeds_in_transformers_siglip_model_as_in_dsclip(tmp_path):
    """timm's SigLIP ViT-B/32 tower (no class token, attention-pool head, GELU-tanh) and SigLIP's text tower
    (bidirectional, last token, biased projection) -> SiglipModel; the demo sentencepiece tokenizer ships as a
    tokenizer.json that SiglipProcessor loads (no EOS renumbering: SigLIP pools the last position)."""
    tok = _demo_tokenizer(16)
    cfg = copy.deepcopy(SIGLIP_B32)
    cfg["text_cfg"]["vocab_size"] = tok.vocab_size
    torch.manual_seed(0)
    ours = _perturbed(create_model(cfg))
    pre = {"resize_mode": "squash", "mean": [0.5] * 3, "std": [0.5] * 3}
    spm = TokenizerSource("spm", path=Path(tok.model_path))
    export_state_dict(ours.state_dict(), ours.config, tmp_path, tokenizer=spm, preprocess_cfg=pre)
    hf = transformers.SiglipModel.from_pretrained(tmp_path).eval()
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)
    assert type(processor).__name__ == "SiglipProcessor"
    assert (
        processor.image_processor.size == {"height": 256, "width": 256} and not processor.image_processor.do_center_crop
    )
    assert hf.config.vision_config.hidden_act == hf.config.text_config.hidden_act == "gelu_pytorch_tanh"

    got = processor(text=CAPTIONS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    assert set(got) == {"input_ids"}  # no attention mask: SigLIP's text tower attends to the padding, as dsclip's
    ids = tok(CAPTIONS)
    assert torch.equal(got["input_ids"], ids)
    images = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(**got, pixel_values=images)
    _assert_same_outputs(ours, out, images, ids, ours.config)
    assert torch.equal(hf.logit_bias.detach(), ours.logit_bias.detach())


# --- what transformers cannot express: one line naming it -------------------------------------------------------
def _refusal(cfg) -> str:
    from dsclip.checkpoint.hf_export import check_exportable
    from dsclip.model.config import resolve_model_config

    with pytest.raises(ConfigError) as e:
        check_exportable(resolve_model_config(cfg))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--format hf: transformers'")
    return msg


def test_architectures_transformers_cannot_express_are_refused_in_one_line():
    from dsclip.model import get_model_config
    from tests.unit.test_timm_towers import TINY_SIGLIP

    tiny = get_model_config("tiny")
    ls = copy.deepcopy(tiny)
    ls["vision_cfg"]["ls_init_value"] = 0.1
    assert "layer scale" in _refusal(ls)
    last = copy.deepcopy(tiny)
    last["text_cfg"]["pool_type"] = "last"
    assert "text pooling 'last'" in _refusal(last)
    assert "CLIPModel" in _refusal({**TINY_SIGLIP, "init_logit_bias": None}) and "image tower timm:" in _refusal(
        {**TINY_SIGLIP, "init_logit_bias": None}
    )
    msg = _refusal(TINY_SIGLIP)  # vit_tiny_patch16_224 with a map pool keeps timm's class token
    assert "SiglipModel" in msg and "an image class token" in msg
    causal = copy.deepcopy(SIGLIP_B32)
    causal["text_cfg"].update(no_causal_mask=False, pool_type="argmax")
    msg = _refusal(causal)
    assert "a causal text mask" in msg and "text pooling 'argmax'" in msg
    assert "OpenCLIP's ViT image tower" in _refusal({**tiny, "init_logit_bias": -10})  # demo-like tower + --siglip


# --- from an OpenCLIP file (--pretrained-style input), through the CLI entry point ------------------------------
def test_openclip_file_converts_to_transformers(tmp_path, capsys):
    open_clip = pytest.importorskip("open_clip")
    from dsclip.checkpoint.convert import main_convert
    from dsclip.model import openclip_model_config

    cfg = _vit_b_32_2_layers().config
    torch.manual_seed(3)
    oc = open_clip.CLIP(**openclip_model_config(cfg)["model_cfg"]).eval()
    # OpenCLIP's training checkpoint format: DDP "module." prefixes inside "state_dict"
    path = tmp_path / "epoch_1.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in oc.state_dict().items()}}, path)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / "hf"
    assert (
        main_convert([str(path), "--format", "hf", "--model-config", str(tmp_path / "cfg.json"), "-o", str(out)]) == 0
    )
    assert "converted" in capsys.readouterr().out
    hf = transformers.CLIPModel.from_pretrained(out).eval()
    processor = transformers.CLIPProcessor.from_pretrained(out)  # OpenCLIP's BPE vocabulary: its tokenizer
    tokens = processor(text=CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # against OpenCLIP itself, on OpenCLIP's own tokens
        out_hf = hf(**tokens, pixel_values=images)
        ref_image = oc.encode_image(images, normalize=True)
        ref_text = oc.encode_text(open_clip.get_tokenizer("ViT-B-32")(CAPTIONS), normalize=True)
    tol = embedding_tol(cfg)
    torch.testing.assert_close(out_hf.image_embeds, ref_image, rtol=0, atol=tol)
    torch.testing.assert_close(out_hf.text_embeds, ref_text, rtol=0, atol=tol)
    assert float(hf.logit_scale.detach()) == float(oc.logit_scale.detach())  # ln(1/0.07) < ln(100): not clamped

    # an OpenCLIP local-dir export folder: the architecture and the image preprocessing come from its config
    from dsclip.model import export_openclip
    from dsclip.model.openclip import from_openclip_state_dict

    pre = {"resize_mode": "squash", "interpolation": "bilinear", "mean": [0.5] * 3, "std": [0.25] * 3}
    export_openclip(from_openclip_state_dict(oc.state_dict(), cfg), cfg, tmp_path / "oc", pre)
    assert main_convert([str(tmp_path / "oc"), "--format", "hf", "-o", str(tmp_path / "hf2")]) == 0
    images2 = transformers.CLIPProcessor.from_pretrained(tmp_path / "hf2").image_processor
    assert images2.size == {"height": 224, "width": 224} and not images2.do_center_crop and images2.resample == 2
    assert list(images2.image_mean) == [0.5] * 3 and list(images2.image_std) == [0.25] * 3
    hf2 = transformers.CLIPModel.from_pretrained(tmp_path / "hf2")
    assert all(torch.equal(v, hf2.state_dict()[k]) for k, v in hf.state_dict().items())

    with pytest.raises(ConfigError, match="writes a folder"):
        main_convert([str(path), "--format", "hf", "--model-config", str(tmp_path / "cfg.json"), "-o", "x.safetensors"])
    with pytest.raises(ConfigError, match="already exists"):  # never over an existing export without --force
        main_convert([str(path), "--format", "hf", "--model-config", str(tmp_path / "cfg.json"), "-o", str(out)])
