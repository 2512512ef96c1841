"""ZeRO-2/3 training on 2 gloo ranks -> ``dsclip convert`` -> plain models that embed like the live engine.

Each rank builds the real engine (dsclip.engine.build), takes two optimizer steps with the gradient
cache, saves through the Checkpointer and embeds fixed inputs with the live (partitioned) engine.
The test then converts the checkpoint in this process (no training world) and checks:
- dsclip format -> ``load_model``: every tensor equals DeepSpeed's fp32 master (safe_get_full_fp32_param)
  and, for fp32 training, the embeddings equal the engine's within 1e-5;
- hf format -> ``transformers.CLIPModel.from_pretrained``: embeddings match dsclip's within 3e-5;
- open_clip format -> ``open_clip.create_model_and_transforms`` (local-dir: and name + pretrained=file)
  loads with strict=True and ``encode_image``/``encode_text`` match dsclip's within 1e-5;
- an OpenCLIP model imported under ZeRO-3 (``load_pretrained_into`` after zero.Init) embeds like OpenCLIP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsclip.model import create_model  # imported before zero.Init patches torch.Tensor (timm -> dynamo)
from dsclip.testing.gloo_world import run_world
from tests.tolerances import embedding_tol

pytestmark = [pytest.mark.dist]
SEED, B = 1234, 4
VOCAB, EOS = 256, 2
# Same fp32 weights, other code path (converted file, OpenCLIP's modules, a partitioned engine): L2-normalised
# embeddings agree to rounding over the forward pass's chained sums (tests/tolerances.embedding_tol): 3e-5.
EMB_TOL = embedding_tol(create_model("tiny", vocab_size=VOCAB, device="meta").config)


def _inputs(n=6, seed=7):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 32, 32, generator=g)
    tokens = torch.randint(3, VOCAB, (n, 32), generator=g)
    for row in range(n):  # EOS then padding, as the tokenizer writes them
        pos = 5 + 3 * row
        tokens[row, pos] = EOS
        tokens[row, pos + 1 :] = 0
    return images, tokens


def _model():
    torch.manual_seed(SEED)
    return create_model("tiny", vocab_size=VOCAB, eos_id=EOS, pad_id=0)


def _engine(world, ds_config, after_construction=None):
    from dsclip.config import make_run_config
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config

    cfg = make_run_config(
        {
            "name": "t",
            "batch_size": B,
            "lr": 1e-2,
            "wd": 0.1,
            "warmup": 0,
            "lr_scheduler": "const",
            "precision": "auto",
            "deepspeed_config": f"ds_configs/{ds_config}.json",
        }
    )
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    return build_engine(
        ds, cfg.train, cfg.optim, _model, total_steps=10, steps_per_epoch=10, after_construction=after_construction
    )


def _embed(module):
    images, tokens = _inputs()
    images = images.to(next(module.parameters()).dtype)  # a bf16 engine's module holds bf16 weights
    module.eval()
    with torch.no_grad():  # under ZeRO-3 every rank must run the forward (it gathers parameters)
        return module.encode_image(images).float(), module.encode_text(tokens).float()


def _rank_train_and_save(rank, world, ds_config, run_dir):
    from deepspeed.utils import safe_get_full_fp32_param

    from dsclip.checkpoint.ds_checkpoint import Checkpointer
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    bundle = _engine(world, ds_config)
    engine = bundle.engine
    step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=torch.bfloat16 if "bf16" in ds_config else None)
    g = torch.Generator().manual_seed(SEED + rank)
    for _ in range(2):
        images = torch.randn(B, 3, 32, 32, generator=g)
        tokens = torch.randint(3, VOCAB, (B, 32), generator=g)
        tokens[:, 12], tokens[:, 13:] = EOS, 0
        engine.train()
        step([(images, tokens)])
    Checkpointer(Path(run_dir), every_n_steps=1, every_n_epochs=0, keep_last=0, rank=rank).save(
        engine, 2, {"step": 2, "epoch": 0, "step_in_epoch": 2, "world_size": world}
    )
    image_emb, text_emb = _embed(engine.module)
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return {"image": image_emb, "text": text_emb, "masters": masters}


def _convert(args):
    from dsclip.checkpoint.convert import main_convert

    assert main_convert([str(a) for a in args]) == 0


@pytest.mark.parametrize("ds_config", ["zero2_fp32", "zero3_fp32", "zero3_bf16"])
def test_convert_matches_live_engine_and_openclip_loads_it(tmp_path, ds_config):
    from dsclip.model import load_model

    run = tmp_path / "run"
    live = run_world(_rank_train_and_save, 2, ds_config, str(run))[0]
    exact = "fp32" in ds_config  # bf16 engines embed with bf16 weights; the file holds the fp32 masters

    _convert([run, "-o", tmp_path / "ds"])
    model = load_model(tmp_path / "ds")
    sd = model.state_dict()
    assert set(sd) == set(live["masters"])
    for name, master in live["masters"].items():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name], master.reshape(sd[name].shape)), name
    image_emb, text_emb = _embed(model)
    if exact:
        torch.testing.assert_close(image_emb, live["image"], rtol=0, atol=EMB_TOL)
        torch.testing.assert_close(text_emb, live["text"], rtol=0, atol=EMB_TOL)
    else:  # sanity only: bf16 compute weights vs fp32 masters
        assert torch.nn.functional.cosine_similarity(image_emb, live["image"]).min() > 0.99

    # bf16 output: the same numbers rounded
    _convert([run / "checkpoints", "--dtype", "bf16", "-o", tmp_path / "bf16" / "weights.safetensors"])
    half = load_model(tmp_path / "bf16" / "weights.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in half.state_dict().values())
    assert torch.equal(half.state_dict()["visual.proj"], sd["visual.proj"].bfloat16())

    # transformers' layout, loaded by transformers' CLIPModel itself: the converted dsclip model's embeddings. With
    # the run's tokenizer recorded as training records it (the demo one: 256 pieces, EOS 2, UNK 1), EOS pooling at
    # id 2 is exported with EOS and UNK exchanged (transformers reads eos_token_id 2 as argmax pooling)
    transformers = pytest.importorskip("transformers")
    from dsclip.checkpoint.ds_checkpoint import record_tokenizer
    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer

    record_tokenizer(run, SentencePieceTokenizer(ensure_demo_tokenizer(tmp_path / "spm"), 32))
    _convert([run, "--format", "hf", "-o", tmp_path / "hf"])
    hf = transformers.CLIPModel.from_pretrained(tmp_path / "hf").eval()
    images, tokens = _inputs()
    assert hf.config.text_config.eos_token_id == 1 and not (tokens == 1).any()
    with torch.no_grad():
        out = hf(input_ids=torch.where(tokens == EOS, 1, tokens), pixel_values=images)
    torch.testing.assert_close(out.image_embeds, image_emb, rtol=0, atol=EMB_TOL)
    torch.testing.assert_close(out.text_embeds, text_emb, rtol=0, atol=EMB_TOL)

    # OpenCLIP layout, loaded by open_clip itself with strict=True
    open_clip = pytest.importorskip("open_clip")
    _convert([run / "checkpoints" / "step_000000002", "--format", "open_clip", "-o", tmp_path / "oc"])
    oc_cfg = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())
    oc_local, _, _ = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    name = f"dsclip-test-{ds_config}"  # a "standard" config: registered by name, weights via pretrained=file
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / f"{name}.json").write_text(json.dumps(oc_cfg["model_cfg"]))
    open_clip.add_model_config(tmp_path / "cfgs")
    oc_named, _, _ = open_clip.create_model_and_transforms(
        name, pretrained=str(tmp_path / "oc" / "open_clip_model.safetensors")
    )
    images, tokens = _inputs()
    for oc in (oc_local, oc_named):
        oc.eval()
        assert oc.logit_scale.shape == torch.Size([])
        with torch.no_grad():
            torch.testing.assert_close(oc.encode_image(images, normalize=True), image_emb, rtol=0, atol=EMB_TOL)
            torch.testing.assert_close(oc.encode_text(tokens, normalize=True), text_emb, rtol=0, atol=EMB_TOL)


def _rank_import_openclip(rank, world, path, ds_config):
    from dsclip.checkpoint.pretrained import load_pretrained_into

    bundle = _engine(world, ds_config, after_construction=lambda m: load_pretrained_into(m, path))
    return _embed(bundle.engine.module)


@pytest.mark.parametrize("ds_config", ["zero3_fp32", "zero2_fp32"])
def test_openclip_checkpoint_imported_under_zero_embeds_like_openclip(tmp_path, ds_config):
    open_clip = pytest.importorskip("open_clip")
    from dsclip.model import openclip_model_config

    cfg = _model().config
    torch.manual_seed(99)
    oc = open_clip.CLIP(**openclip_model_config(cfg)["model_cfg"])
    with torch.no_grad():  # move every tensor off its init value so a skipped copy shows
        for p in oc.parameters():
            p.add_(0.01 * torch.randn_like(p))
    # OpenCLIP's training checkpoint format: DDP "module." prefixes inside "state_dict"
    path = tmp_path / "epoch_1.pt"
    torch.save({"epoch": 1, "name": "x", "state_dict": {f"module.{k}": v for k, v in oc.state_dict().items()}}, path)
    from dsclip.checkpoint.pretrained import ZERO3_IMPORT_MIN
    from dsclip.engine.versions import at_least

    if ds_config.startswith("zero3") and not at_least(ZERO3_IMPORT_MIN):  # CI's oldest DeepSpeed: refused
        with pytest.raises(RuntimeError, match=f"needs DeepSpeed >= {ZERO3_IMPORT_MIN}"):
            run_world(_rank_import_openclip, 2, str(path), ds_config)
        return
    results = run_world(_rank_import_openclip, 2, str(path), ds_config)
    images, tokens = _inputs()
    oc.eval()
    with torch.no_grad():
        ref = oc.encode_image(images, normalize=True), oc.encode_text(tokens, normalize=True)
    for image_emb, text_emb in results:
        torch.testing.assert_close(image_emb, ref[0], rtol=0, atol=EMB_TOL)
        torch.testing.assert_close(text_emb, ref[1], rtol=0, atol=EMB_TOL)
