"""dsclip <-> OpenCLIP: parameter counts, state-dict conversion both ways, identical embeddings."""

import json
from pathlib import Path

import pytest
import torch

from dsclip.model import (
    StateDictMismatchError,
    create_model,
    export_openclip,
    from_openclip_state_dict,
    get_model_config,
    load_model,
    load_openclip_checkpoint,
    openclip_model_config,
    to_openclip_state_dict,
)
from tests.tolerances import embedding_tol

open_clip = pytest.importorskip("open_clip")

BIG = ["ViT-B-32", "ViT-B-16", "ViT-L-14", "ViT-H-14", "ViT-g-14", "ViT-bigG-14"]


def _openclip_model(cfg: dict):
    """open_clip.CLIP from a (resolved) OpenCLIP-schema config, default random init."""
    return open_clip.CLIP(**openclip_model_config(cfg)["model_cfg"])


def _tiny_cfg(pool_type="argmax", **vision):
    cfg = get_model_config("tiny")
    cfg["text_cfg"].update(pool_type=pool_type, eos_id=3)
    cfg["vision_cfg"].update(vision)
    return cfg


def _inputs(cfg, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    images = torch.randn(batch, 3, v["image_size"], v["image_size"], generator=g)
    tokens = torch.randint(4, t["vocab_size"], (batch, t["context_length"]), generator=g)
    eos_pos = torch.randint(1, t["context_length"], (batch,), generator=g)
    for row, pos in enumerate(eos_pos.tolist()):  # eos then padding, like a tokenizer would produce
        tokens[row, pos] = 3
        tokens[row, pos + 1 :] = 0
    return images, tokens


def _assert_same_embeddings(oc_model, ds_model, cfg):
    """Same weights through timm/dsclip and OpenCLIP modules: the sums are taken in other orders, so the
    embeddings agree to rounding over the forward pass (tests/tolerances.embedding_tol), scaled by the
    embeddings' largest entry (1 once normalised)."""
    images, tokens = _inputs(cfg)
    oc_model.eval()
    ds_model.eval()
    with torch.no_grad():
        for normalize in (False, True):
            for encode, x in (("encode_image", images), ("encode_text", tokens)):
                want = getattr(oc_model, encode)(x, normalize=normalize)
                atol = embedding_tol(cfg, float(want.abs().max()))
                torch.testing.assert_close(getattr(ds_model, encode)(x, normalize=normalize), want, rtol=0, atol=atol)
    assert torch.equal(ds_model.logit_scale.reshape(()), oc_model.logit_scale.detach())


@pytest.mark.parametrize("name", BIG)
def test_param_count_matches_openclip_on_meta(name):
    cfg = get_model_config(name)
    with torch.device("meta"):
        oc = open_clip.CLIP(**cfg)
    ds = create_model(name, device="meta")
    assert sum(p.numel() for p in ds.parameters()) == sum(p.numel() for p in oc.parameters())
    oc_shapes = {k: v.shape for k, v in oc.state_dict().items()}
    converted = to_openclip_state_dict(ds.state_dict())
    assert {k: v.shape for k, v in converted.items()} == oc_shapes


@pytest.mark.parametrize(
    "pool_type,extra",
    [
        ("argmax", {}),
        ("eos", {}),
        ("last", {}),
        ("eos", {"quick_gelu": True}),
        ("argmax", {"init_logit_bias": -10.0, "ls_init_value": 0.1}),
    ],
)
def test_openclip_to_dsclip_same_embeddings(pool_type, extra):
    cfg = _tiny_cfg(pool_type)
    if "quick_gelu" in extra:
        cfg["quick_gelu"] = True
    if "init_logit_bias" in extra:
        cfg["init_logit_bias"] = extra["init_logit_bias"]
    if "ls_init_value" in extra:
        cfg["vision_cfg"]["ls_init_value"] = cfg["text_cfg"]["ls_init_value"] = extra["ls_init_value"]
    torch.manual_seed(0)
    oc = _openclip_model(cfg)
    ds = create_model(cfg)
    ds.load_state_dict(from_openclip_state_dict(oc.state_dict(), cfg), strict=True)
    _assert_same_embeddings(oc, ds, cfg)
    if "init_logit_bias" in extra:
        assert ds.logit_bias.shape == (1,) and ds.logit_bias.item() == oc.logit_bias.item()


@pytest.mark.parametrize("pool_type", ["argmax", "eos"])
def test_dsclip_to_openclip_strict_load_same_embeddings(pool_type):
    cfg = _tiny_cfg(pool_type)
    torch.manual_seed(1)
    ds = create_model(cfg)
    with torch.no_grad():
        ds.logit_scale.fill_(3.0)
    oc = _openclip_model(cfg)
    oc_sd = to_openclip_state_dict(ds.state_dict(), cfg)
    assert oc_sd["logit_scale"].dim() == 0 and oc_sd["visual.class_embedding"].shape == (64,)
    oc.load_state_dict(oc_sd, strict=True)
    _assert_same_embeddings(oc, ds, cfg)


def test_patch_dropout_models_agree_in_eval():
    cfg = _tiny_cfg("eos", patch_dropout=0.5)
    torch.manual_seed(2)
    oc = _openclip_model(cfg)
    ds = create_model(cfg)
    ds.load_state_dict(from_openclip_state_dict(oc.state_dict(), cfg), strict=True)
    _assert_same_embeddings(oc, ds, cfg)  # eval: no patches dropped on either side
    images, _ = _inputs(cfg)
    ds.train()
    with torch.no_grad():
        assert not torch.allclose(ds.encode_image(images), oc.encode_image(images), atol=1e-3)


def test_wrappers_prefixes_and_checkpoint_files(tmp_path: Path):
    cfg = _tiny_cfg()
    torch.manual_seed(3)
    oc = _openclip_model(cfg)
    sd = oc.state_dict()
    wrapped = {"state_dict": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3}
    wrapped["state_dict"]["module.logit_scale"] = sd["logit_scale"].reshape(1)  # nonscalar variant
    torch.save(wrapped, tmp_path / "epoch_3.pt")
    from safetensors.torch import save_file

    save_file(sd, str(tmp_path / "oc.safetensors"))
    for source in (
        wrapped,
        load_openclip_checkpoint(tmp_path / "epoch_3.pt"),
        load_openclip_checkpoint(tmp_path / "oc.safetensors"),
    ):
        ds = create_model(cfg)
        ds.load_state_dict(from_openclip_state_dict(source, cfg), strict=True)
        _assert_same_embeddings(oc, ds, cfg)


def test_key_map_errors_name_the_keys():
    cfg = _tiny_cfg()
    oc_sd = _openclip_model(cfg).state_dict()
    missing = dict(oc_sd)
    del missing["visual.transformer.resblocks.1.attn.in_proj_weight"]
    with pytest.raises(
        StateDictMismatchError,
        match=r"missing \(1\): visual\.transformer\.resblocks\.1\.attn\.in_proj_weight",
    ):
        from_openclip_state_dict(missing, cfg)

    extra = dict(oc_sd, **{"visual.attn_pool.query": torch.zeros(1)})
    with pytest.raises(StateDictMismatchError, match=r"unexpected \(1\): visual\.attn_pool\.query"):
        from_openclip_state_dict(extra, cfg)

    wrong = dict(oc_sd, token_embedding__weight=None)
    del wrong["token_embedding__weight"]
    wrong["token_embedding.weight"] = torch.zeros(999, 64)
    with pytest.raises(
        StateDictMismatchError, match=r"token_embedding\.weight: got \(999, 64\), expected \(1000, 64\)"
    ):
        from_openclip_state_dict(wrong, cfg)

    ds_sd = create_model(cfg).state_dict()
    ds_sd["visual.something_new"] = torch.zeros(1)
    with pytest.raises(StateDictMismatchError, match="visual.something_new"):
        to_openclip_state_dict(ds_sd)


def test_export_loads_in_openclip_local_dir(tmp_path: Path):
    cfg = _tiny_cfg("eos")
    torch.manual_seed(4)
    ds = create_model(cfg)
    export_openclip(ds.state_dict(), ds.config, tmp_path, preprocess_cfg={"mean": [0.5] * 3})
    written = json.loads((tmp_path / "open_clip_config.json").read_text())
    assert written == openclip_model_config(ds.config, {"mean": [0.5] * 3})
    assert written["preprocess_cfg"]["size"] == 32
    oc = open_clip.create_model(f"local-dir:{tmp_path}")
    _assert_same_embeddings(oc, ds, cfg)
    # dsclip.model.load_model reads the same OpenCLIP-layout folder back
    _assert_same_embeddings(oc, load_model(tmp_path), cfg)
