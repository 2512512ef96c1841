"""dsclip.model: configs, shapes, gradients, logit scale, patch dropout, checkpointing, pooling, I/O."""

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsclip.model import (
    CLIP,
    StateDictMismatchError,
    UnknownModelError,
    create_model,
    get_model_config,
    list_models,
    load_model,
    save_model,
)
from dsclip.model.text import text_pool

BIG = ["ViT-B-32", "ViT-B-16", "ViT-L-14", "ViT-H-14", "ViT-g-14", "ViT-bigG-14"]


def _inputs(model: CLIP, batch: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    size = model.image_size
    images = torch.randn(batch, 3, size, size, generator=g)
    tokens = torch.randint(3, model.config["text_cfg"]["vocab_size"], (batch, model.context_length), generator=g)
    return images, tokens


def _clip_loss(out: dict) -> torch.Tensor:
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
    if out["logit_bias"] is not None:
        logits = logits + out["logit_bias"]
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


# -- registry / config ----------------------------------------------------------------------------
def test_registry_lists_shipped_configs():
    assert set(BIG + ["tiny", "demo"]) <= set(list_models())


def test_unknown_model_lists_available_names():
    with pytest.raises(UnknownModelError, match="ViT-B-32") as exc:
        get_model_config("ViT-Nope-1")
    assert isinstance(exc.value, ValueError)
    assert "tiny" in str(exc.value)


def test_get_model_config_from_json_path(tmp_path: Path):
    cfg = get_model_config("tiny")
    (tmp_path / "bare.json").write_text(json.dumps(cfg))
    (tmp_path / "wrapped.json").write_text(json.dumps({"model_cfg": cfg}))
    assert get_model_config(tmp_path / "bare.json") == cfg
    assert get_model_config(str(tmp_path / "wrapped.json")) == cfg


def test_unsupported_config_option_is_an_error():
    cfg = get_model_config("tiny")
    cfg["vision_cfg"]["attentional_pool"] = True
    with pytest.raises(ValueError, match="attentional_pool"):
        create_model(cfg, device="meta")
    cfg = get_model_config("tiny")
    cfg["text_cfg"]["no_such_key"] = 1
    with pytest.raises(ValueError, match="no_such_key"):
        create_model(cfg, device="meta")


@pytest.mark.parametrize(
    "name,count", [("ViT-B-32", 151_277_313), ("ViT-bigG-14", 2_539_567_105), ("tiny", None), ("demo", None)]
)
def test_param_counts_known_values(name, count):
    model = create_model(name, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert next(model.parameters()).device.type == "meta"
    if count is not None:
        assert n == count


def test_create_model_overrides():
    m = create_model("tiny", vocab_size=500, context_length=16, eos_id=7, pad_id=3, patch_dropout=0.25, device="meta")
    t = m.config["text_cfg"]
    assert (t["vocab_size"], t["context_length"], t["eos_id"], t["pad_id"]) == (500, 16, 7, 3)
    assert t["pool_type"] == "eos"  # eos_id given on an argmax config
    assert m.text.token_embedding.weight.shape == (500, 64)
    assert m.text.positional_embedding.shape == (16, 64)
    assert m.visual.patch_drop.prob == 0.25 and m.config["vision_cfg"]["patch_dropout"] == 0.25
    # an explicit non-argmax pooling is kept
    cfg = get_model_config("tiny")
    cfg["text_cfg"]["pool_type"] = "last"
    assert create_model(cfg, eos_id=7, device="meta").config["text_cfg"]["pool_type"] == "last"
    # OpenCLIP-style float: a rate override, train-only (open_clip create_model(force_patch_dropout=...))
    m = create_model("tiny", force_patch_dropout=0.5, device="meta")
    assert m.visual.patch_drop.prob == 0.5 and not m.visual.patch_drop.force
    m = create_model("tiny", force_patch_dropout=True, device="meta")
    assert m.visual.patch_drop.prob == 0.0 and m.visual.patch_drop.force


def test_model_config_is_resolved_and_json_serialisable():
    m = create_model("ViT-H-14", device="meta")
    v = m.config["vision_cfg"]
    assert v["head_width"] == 80 and v["mlp_ratio"] == 4.0 and v["patch_dropout"] == 0.0
    assert m.visual.blocks[0].attn.num_heads == 16
    assert json.loads(json.dumps(m.config)) == m.config


# -- forward ---------------------------------------------------------------------------------------
def test_forward_shapes_and_normalisation():
    torch.manual_seed(0)
    model = create_model("tiny")
    images, tokens = _inputs(model, batch=3)
    out = model(image=images, text=tokens)
    assert out["image_features"].shape == (3, 32) and out["text_features"].shape == (3, 32)
    torch.testing.assert_close(out["image_features"].norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out["text_features"].norm(dim=-1), torch.ones(3))
    assert out["logit_scale"].dim() == 0 and out["logit_bias"] is None
    assert math.isclose(out["logit_scale"].item(), 1 / 0.07, rel_tol=1e-5)
    assert model.encode_image(images, normalize=False).shape == (3, 32)
    assert model.encode_text(tokens[:, :10], normalize=False).shape == (3, 32)  # shorter than context
    only_text = model(text=tokens)
    assert only_text["image_features"] is None and only_text["text_features"].shape == (3, 32)


def test_logit_scale_param_is_1d_and_clamped_in_forward():
    model = create_model("tiny")
    assert model.logit_scale.shape == (1,)
    assert math.isclose(model.logit_scale.item(), math.log(1 / 0.07), rel_tol=1e-6)
    with torch.no_grad():
        model.logit_scale.fill_(10.0)  # exp(10) >> 100
    out = model(text=_inputs(model)[1])
    assert out["logit_scale"].dim() == 0
    assert math.isclose(out["logit_scale"].item(), 100.0, rel_tol=1e-5)
    assert model.logit_scale.item() == 10.0  # the parameter itself is untouched


def test_siglip_logit_bias():
    model = create_model("tiny", init_logit_bias=-10.0)
    assert model.logit_bias.shape == (1,) and model.logit_bias.item() == -10.0
    assert math.isclose(model.logit_scale.item(), math.log(10.0), rel_tol=1e-6)
    out = model(text=_inputs(model)[1])
    assert out["logit_bias"].dim() == 0 and out["logit_bias"].item() == -10.0
    assert "logit_bias" in model.no_weight_decay()


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = create_model("tiny", init_logit_bias=-10.0, patch_dropout=0.5)
    model.train()
    images, tokens = _inputs(model)
    _clip_loss(model(image=images, text=tokens)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_same_seed_same_weights():
    torch.manual_seed(5)
    a = create_model("tiny").state_dict()
    torch.manual_seed(5)
    b = create_model("tiny").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_openclip_init_statistics():
    torch.manual_seed(0)
    model = create_model("demo")
    width, layers = 128, 4
    text_blk = model.text.blocks[0]
    assert abs(model.text.token_embedding.weight.std().item() - 0.02) < 2e-3
    assert abs(text_blk.attn.qkv.weight.std().item() - width**-0.5) < 0.01
    assert abs(text_blk.mlp.fc2.weight.std().item() - width**-0.5 * (2 * layers) ** -0.5) < 0.01
    assert abs(model.visual.pos_embed.std().item() - width**-0.5) < 0.01
    for blk in (*model.visual.blocks, *model.text.blocks):
        assert not blk.attn.qkv.bias.any() and not blk.attn.proj.bias.any()


def test_init_weights_with_partitioned_parameters():
    """ZeRO-3 zero.Init partitions each layer as soon as it is built (an empty tensor + ds_shape);
    init_weights(gather=...) must initialise layer by layer through the gather context."""
    model = create_model("tiny")
    partitioned = [p for n, p in model.named_parameters() if ".blocks." in n]
    for p in partitioned:
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    with pytest.raises(RuntimeError, match="partitioned"):
        model.init_weights()
    gathered = []

    @contextlib.contextmanager
    def gather(params):
        gathered.append(len(params))
        for p in params:
            if hasattr(p, "ds_shape") and p.numel() == 0:
                p.data = torch.full(p.ds_shape, float("nan"))
        yield

    model.init_weights(gather=gather)
    assert max(gathered) <= 3  # one module's own parameters at a time (cls, pos, proj at most)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not model.text.blocks[1].attn.qkv.bias.any()


def test_no_weight_decay_names_exist():
    model = create_model("tiny", device="meta")
    names = dict(model.named_parameters())
    nwd = model.no_weight_decay()
    assert nwd <= set(names)
    assert {"visual.cls_token", "visual.pos_embed", "text.positional_embedding", "logit_scale"} <= nwd
    assert "text.token_embedding.weight" in nwd


# -- patch dropout ---------------------------------------------------------------------------------
def _visual_tokens(model: CLIP, images: torch.Tensor) -> int:
    seen = []
    handle = model.visual.norm_pre.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    model.encode_image(images)
    handle.remove()
    return seen[0]


def test_patch_dropout_train_eval_and_forced():
    model = create_model("tiny", patch_dropout=0.5)  # 32px / patch 8 -> 16 patches + class token
    images, _ = _inputs(model)
    model.train()
    assert _visual_tokens(model, images) == 1 + 8
    model.eval()
    assert _visual_tokens(model, images) == 1 + 16
    forced = create_model("tiny", patch_dropout=0.5, force_patch_dropout=True).eval()
    assert _visual_tokens(forced, images) == 1 + 8
    model.set_patch_dropout(force=True)
    assert _visual_tokens(model, images) == 1 + 8
    model.set_patch_dropout(0.0, force=False)
    assert _visual_tokens(model.train(), images) == 1 + 16


# -- gradient checkpointing -----------------------------------------------------------------------
def test_grad_checkpointing_calls_fn_per_block_and_matches():
    torch.manual_seed(0)
    model = create_model("tiny")
    images, tokens = _inputs(model)

    def grads():
        model.zero_grad(set_to_none=True)
        _clip_loss(model(image=images, text=tokens)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads()
    calls = []

    def counting_checkpoint(function, *args):
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    model.set_grad_checkpointing(True, checkpoint_fn=counting_checkpoint)
    checkpointed = grads()
    n_blocks = model.config["vision_cfg"]["layers"] + model.config["text_cfg"]["layers"]
    assert len(calls) == n_blocks
    for n in reference:
        torch.testing.assert_close(checkpointed[n], reference[n], rtol=0, atol=0, msg=n)

    model.set_grad_checkpointing(True)  # default torch checkpoint
    for n, g in grads().items():
        torch.testing.assert_close(g, reference[n], rtol=0, atol=0, msg=n)
    with torch.no_grad():  # no checkpointing without autograd
        calls.clear()
        model.set_grad_checkpointing(True, checkpoint_fn=counting_checkpoint)
        model(image=images, text=tokens)
        assert not calls
    model.set_grad_checkpointing(False)
    _clip_loss(model(image=images, text=tokens))
    assert not calls


# -- text pooling ----------------------------------------------------------------------------------
def test_text_pooling_modes():
    x = torch.arange(2 * 5, dtype=torch.float32).reshape(2, 5, 1)  # value = 5 * row + position
    text = torch.tensor([[9, 4, 2, 0, 2], [1, 2, 7, 0, 0]])
    assert text_pool(x, text, "first").flatten().tolist() == [0, 5]
    assert text_pool(x, text, "last").flatten().tolist() == [4, 9]
    assert text_pool(x, text, "argmax").flatten().tolist() == [0, 7]  # highest id: 9 at 0, 7 at 2
    assert text_pool(x, text, "eos", eos_id=2).flatten().tolist() == [2, 6]  # FIRST eos: pos 2, pos 1
    with pytest.raises(ValueError):
        text_pool(x, text, "mean")


def test_text_tower_is_causal():
    model = create_model("tiny").eval()
    _, tokens = _inputs(model, batch=2)
    changed = tokens.clone()
    changed[:, 20:] = 5
    a = model.text.forward_features(tokens)
    b = model.text.forward_features(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


# -- weights I/O -----------------------------------------------------------------------------------
def test_save_and_load_model_roundtrip(tmp_path: Path):
    torch.manual_seed(0)
    model = create_model("tiny", vocab_size=300, eos_id=2, init_logit_bias=-5.0).eval()
    weights = save_model(model, tmp_path / "export")
    assert weights.name == "model.safetensors"
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_cfg"] == model.config
    for path in (tmp_path / "export", weights):
        loaded = load_model(path)
        assert not loaded.training
        images, tokens = _inputs(loaded)
        with torch.no_grad():
            a, b = model(image=images, text=tokens), loaded(image=images, text=tokens)
        for k in ("image_features", "text_features", "logit_scale", "logit_bias"):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_save_model_bf16_and_state_dict_checks(tmp_path: Path):
    model = create_model("tiny")
    save_model(model.state_dict(), tmp_path, model_config=model.config, dtype=torch.bfloat16)
    loaded = load_model(tmp_path)
    assert loaded.logit_scale.dtype == torch.bfloat16
    sd = model.state_dict()
    del sd["visual.norm.bias"]
    with pytest.raises(StateDictMismatchError, match="visual.norm.bias"):
        save_model(sd, tmp_path / "bad", model_config=model.config)
    with pytest.raises(ValueError, match="model_config"):
        save_model(model.state_dict(), tmp_path / "bad")


def test_model_package_never_imports_deepspeed():
    root = Path(__file__).resolve().parents[2] / "dsclip" / "model"
    for path in root.rglob("*.py"):
        src = path.read_text()
        assert "import deepspeed" not in src and "from deepspeed" not in src, path
