"""SigLIP-style architectures (issue 32): a timm image tower, bidirectional text with a biased projection,
OpenCLIP's ``CustomTextCLIP`` layout. The independent reference is OpenCLIP itself: the same config built by
``open_clip`` and by dsclip, OpenCLIP's weights loaded into dsclip, both run in float64.

Tolerance: the image towers run the same timm modules in the same order (a linear projection is x @ W
against F.linear: rounding only), so they agree to 1e-12 in float64. The text towers differ in kernels only
(OpenCLIP's nn.MultiheadAttention against timm's fused SDPA), so they agree to float64 rounding over a few
layers: 1e-10 is ~1e5 ulps of values of order 1, far below any wiring error (a wrong mask, pool or
projection moves outputs by order 1e-2 or more).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dsclip.model import create_model, export_openclip, from_openclip_state_dict, to_openclip_state_dict
from dsclip.model.lock import LockConfig, apply_locking, image_group_count, image_groups

open_clip = pytest.importorskip("open_clip")
from open_clip.model import CustomTextCLIP  # noqa: E402

# ViT-B-16-SigLIP's layout at test size: timm's vit_tiny (with its class token: the 'map' pool ignores it)
TINY_SIGLIP = {
    "embed_dim": 192,
    "init_logit_bias": -10,
    "custom_text": True,
    "vision_cfg": {"image_size": 224, "timm_model_name": "vit_tiny_patch16_224", "timm_model_pretrained": False,
                   "timm_pool": "map", "timm_proj": "none"},
    "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 64, "heads": 4, "layers": 2, "no_causal_mask": True,
                 "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6}},
}  # fmt: skip


def _variant(proj="none", pool="map", tanh=False, causal=False):
    cfg = copy.deepcopy(TINY_SIGLIP)
    cfg["vision_cfg"].update(timm_proj=proj, timm_pool=pool)
    if proj == "linear":
        cfg["embed_dim"] = 48  # a real projection 192 -> 48
    if tanh:
        cfg["text_cfg"]["act_kwargs"] = {"approximate": "tanh"}  # SigLIP 2
    if causal:
        cfg["text_cfg"].update(no_causal_mask=False, proj_bias=False, pool_type="argmax")
    return cfg


def _openclip(cfg):
    kw = {k: v for k, v in cfg.items() if k != "custom_text"}
    torch.manual_seed(1)
    return CustomTextCLIP(**kw).double().eval()


INPUTS = (torch.randn(2, 3, 224, 224, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
          torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(0)))  # fmt: skip


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(proj="linear", pool="avg"), dict(tanh=True), dict(pool="avg"), dict(causal=True)],
    ids=["siglip", "linear-proj-avg", "siglip2-tanh", "avg-pool", "causal-text"],
)
def test_timm_tower_architecture_computes_what_openclip_computes(variant):
    cfg = _variant(**variant)
    oc = _openclip(cfg)
    ours = create_model(cfg).double().eval()
    ours.load_state_dict(from_openclip_state_dict(oc.state_dict(), ours.config), strict=True)
    image, text = INPUTS
    with torch.no_grad():
        torch.testing.assert_close(ours.visual(image), oc.encode_image(image), rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.text(text), oc.encode_text(text), rtol=0, atol=1e-10)
        out = ours(image, text)
        assert out["logit_bias"].item() == pytest.approx(-10.0)
    # and back: OpenCLIP loads dsclip's weights with strict=True, tensor for tensor
    back = to_openclip_state_dict(ours.state_dict(), ours.config)
    assert set(back) == set(oc.state_dict())
    assert all(torch.equal(back[k], v) for k, v in oc.state_dict().items())


def test_a_causal_text_mask_is_not_what_siglip_computes():
    # guards the 1e-10 above: the one-flag difference (bidirectional vs causal attention) is visible
    cfg = _variant()
    ours = create_model(cfg).double().eval()
    with torch.no_grad():
        bidirectional = ours.text(INPUTS[1])
        ours.text.causal = True
        assert (ours.text(INPUTS[1]) - bidirectional).abs().max() > 1e-3


def test_openclip_loads_the_export_and_embeds_alike(tmp_path):
    cfg = _variant()
    ours = create_model(cfg).eval()
    export_openclip(ours.state_dict(), ours.config, tmp_path / "oc")
    saved = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())["model_cfg"]
    assert saved["custom_text"] is True and saved["vision_cfg"]["timm_model_name"] == "vit_tiny_patch16_224"
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    image, text = INPUTS[0].float(), INPUTS[1]
    with torch.no_grad():
        torch.testing.assert_close(oc.eval().encode_image(image), ours.visual(image), rtol=0, atol=0)
        torch.testing.assert_close(oc.encode_text(text), ours.text(text), rtol=0, atol=1e-5)


def test_the_resolved_config_states_timms_numbers_and_refuses_others():
    cfg = create_model(_variant(), device="meta").config["vision_cfg"]
    # vit_tiny_patch16_224: width 192, 12 blocks, 3 heads (head width 64), timm's LayerNorm eps 1e-6
    assert (cfg["width"], cfg["layers"], cfg["head_width"], cfg["patch_size"]) == (192, 12, 64, 16)
    assert cfg["norm_kwargs"] == {"eps": 1e-6}
    wrong = _variant()
    wrong["vision_cfg"]["width"] = 256
    with pytest.raises(ValueError, match=r"vision_cfg.width=256 \(timm's vit_tiny_patch16_224 has 192\)"):
        create_model(wrong, device="meta")
    wrong = _variant()
    wrong["vision_cfg"]["timm_model_pretrained"] = True
    with pytest.raises(ValueError, match="--pretrained"):
        create_model(wrong, device="meta")


def test_lock_groups_of_a_tower_without_projection():
    model = create_model(_variant(), device="meta")
    groups = image_groups(model)
    assert len(groups) == image_group_count(model.config) == 12 + 1  # stem, 11 blocks, head (no proj)
    assert model.visual.attn_pool in groups[-1]
    apply_locking(model, LockConfig(lock_image=True, lock_image_unlocked_groups=1))
    trainable = {n for n, p in model.visual.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("blocks.11.", "norm.", "attn_pool.")) for n in trainable)
