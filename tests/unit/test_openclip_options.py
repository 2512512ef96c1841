"""OpenCLIP options of issue 15 item 6 / the parity count with OpenCLIP's meaning: --opt, --device,
--dist-backend/--dist-url, --use-bn-sync, --dataset-type synthetic, --imagenet-v2; their bad values as
one-line errors. The multi-process proofs are tests/dist/test_opt_timm.py (timm optimizers under ZeRO-2)
and tests/e2e/test_openclip_options.py (CLI runs)."""

from __future__ import annotations

import sys

import open_clip
import pytest
import torch
from PIL import Image
from torch import nn

from dsclip.config import ConfigError, make_run_config
from dsclip.data import build_tokenizer, build_train_data
from dsclip.data.synthetic import CAPTION, SyntheticDataset
from dsclip.data.transforms import image_transform
from dsclip.engine.ds_config import resolve_ds_config
from dsclip.engine.optim import build_optimizer
from dsclip.engine.world import devices, discovery, process_group
from dsclip.eval.datasets import ImageNetV2Dataset, imagenet_classnames
from dsclip.eval.evaluator import Evaluator
from dsclip.model import create_model
from tests.unit.test_device_binding import fresh_world  # noqa: F401  (fixture)


def cfg(**kw):
    kw.setdefault("name", "t")
    return make_run_config(kw)


def resolve(raw, accelerator="cpu", **kw):
    c = cfg(**kw)
    return resolve_ds_config(raw, c.train, c.optim, world_size=2, device_type=accelerator)


# ---- --opt -------------------------------------------------------------------------------------------


def test_opt_timm_builds_timms_optimizer_over_dsclips_weight_decay_groups():
    from timm.optim import Lion

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, cfg(opt="timm/lion", wd=0.3, lr=1e-3).optim, "cpu")
    assert type(opt) is Lion
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.3]  # biases and norms do not decay
    assert [len(g["params"]) for g in opt.param_groups] == [3, 1]
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.98)
    sgd = build_optimizer(model, cfg(opt="timm/SGD", momentum=0.5).optim, "cpu")  # OpenCLIP lower-cases too
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.5 and sgd.defaults["nesterov"]
    # --opt AdamW is dsclip's own AdamW path (torch's fused kernel on CPU and CUDA), not timm's
    from dsclip.engine.optim import FusedAdamW

    assert type(build_optimizer(model, cfg(opt="AdamW").optim, "cpu")) is FusedAdamW
    assert type(build_optimizer(model, cfg(opt="AdamW").optim, "cuda")) is FusedAdamW


def test_opt_is_a_client_optimizer_and_its_conflicts_are_one_line_errors():
    ds = resolve({}, opt="timm/lion")
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True
    assert resolve({}, opt="timm/sgd", momentum=0.9)["zero_allow_untested_optimizer"]
    with pytest.raises(ConfigError, match=r"--opt timm/lion conflicts with the optimizer block of .* \(type Lamb\)"):
        resolve({"optimizer": {"type": "Lamb"}}, opt="timm/lion")
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="--opt timm/lion with ZeRO-Offload"):
        resolve(offload, opt="timm/lion")
    with pytest.raises(ConfigError, match="--momentum: the optimizer timm/lion takes no momentum"):
        resolve({}, opt="timm/lion", momentum=0.9)
    with pytest.raises(ConfigError, match=r"timm has no optimizer 'lino' \(did you mean timm/lion\?\)"):
        cfg(opt="timm/lino")
    with pytest.raises(ConfigError, match="--opt sgd: use adamw or timm/NAME"):
        cfg(opt="sgd")


# ---- --device, --dist-backend, --dist-url, --use-bn-sync -----------------------------------------------


def test_device_must_agree_with_the_deepspeed_accelerator():
    assert resolve({}, accelerator="cpu", device="cpu")  # the accelerator's type: accepted
    assert resolve({}, accelerator="cuda", device="cuda")
    with pytest.raises(ConfigError, match="--device cuda: the DeepSpeed accelerator here is cpu; use --device cpu"):
        resolve({}, accelerator="cpu", device="cuda")
    with pytest.raises(ConfigError, match="--device cuda:1: give the device type only"):
        cfg(device="cuda:1")


def test_dist_backend_and_url_reach_deepspeed_init_distributed(monkeypatch, fresh_world):  # noqa: F811
    import deepspeed

    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(process_group, "release_shm_workspace", lambda: False)
    process_group.init_distributed(backend="mpi", init_method="tcp://10.0.0.1:2345")
    # a tcp:// or file:// rendezvous needs rank and world size spelled out
    assert (seen["dist_backend"], seen["init_method"], seen["rank"], seen["world_size"]) == (
        "mpi",
        "tcp://10.0.0.1:2345",
        1,
        2,
    )


def test_no_set_device_rank_is_what_dsclip_binds_with_one_gpu_per_process():
    assert cfg(no_set_device_rank=True).train.no_set_device_rank
    # OpenCLIP with the flag uses device "cuda" (= cuda:0 of the process's view) instead of cuda:LOCAL_RANK;
    # dsclip binds index 0 whenever a rank sees one GPU, flag or not
    info = discovery.WorldInfo(7, 3, 8, 4, "n1", 23456, "slurm")
    b = devices.resolve_device(info, {"CUDA_VISIBLE_DEVICES": "3"}, cuda_count=1)
    assert (b.index, b.physical) == (0, "3")


def test_use_bn_sync_is_a_true_no_op_neither_openclip_vits_nor_dsclip_towers_have_batchnorm():
    assert cfg(use_bn_sync=True).train.use_bn_sync
    # OpenCLIP's ViTs are one class (open_clip.transformer.VisionTransformer) at every size: ViT-B-32 stands
    # for them (ViT-L-14 takes 10 s to build here)
    towers = [open_clip.create_model("ViT-B-32", device="meta")]
    towers += [create_model(name, device="meta") for name in ("ViT-B-32", "ViT-L-14", "ViT-bigG-14", "tiny")]
    for m in towers:
        # what OpenCLIP's --use-bn-sync converts (torch.nn.SyncBatchNorm.convert_sync_batchnorm)
        assert not [n for n, x in m.named_modules() if isinstance(x, nn.modules.batchnorm._BatchNorm)]
    rn = open_clip.create_model("RN50", device="meta")  # the check would see BatchNorm where there is some
    assert any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in rn.modules())


# ---- --dataset-type synthetic ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_synthetic_data_is_openclips_black_image_and_dummy_caption(tmp_path, workers):
    c = cfg(dataset_type="synthetic", train_num_samples=12, workers=workers)
    tok = build_tokenizer(c.data, 16, tmp_path)
    data = build_train_data(c.data, tokenizer=tok, image_size=32, batch_size=3, rank=1, world_size=2, seed=0)
    assert data.num_samples == 12 and data.steps_per_epoch == 2
    try:
        batches = list(data.batches(0))
    finally:
        data.close()
    assert len(batches) == 2
    black = image_transform(32, is_train=False)(Image.new("RGB", (32, 32)))  # OpenCLIP's image, normalized
    for images, tokens in batches:
        assert images.shape == (3, 3, 32, 32) and tokens.shape == (3, 16)
        torch.testing.assert_close(images, black.expand(3, -1, -1, -1), rtol=0, atol=0)
        assert (tokens == tok([CAPTION])).all()
    assert len(SyntheticDataset(5, 8, image_transform(8, is_train=True))) == 5
    with pytest.raises(ConfigError, match="--dataset-type synthetic needs --train-num-samples"):
        cfg(dataset_type="synthetic")


# ---- --imagenet-v2 -----------------------------------------------------------------------------------------


def _v2_folder(root, labels):
    d = root / "ImageNetV2-matched-frequency"
    for lab in labels:
        (d / str(lab)).mkdir(parents=True)
        for k in range(2):
            Image.new("RGB", (20, 20), (40 * k, lab % 255, 0)).save(d / str(lab) / f"{k}.jpeg")
    return d


def test_imagenet_v2_folder_reads_openclips_layout_labels_by_folder_number(tmp_path):
    folder = _v2_folder(tmp_path, [0, 2, 10, 999])
    names = list(imagenet_classnames().values())
    for root in (tmp_path, folder):  # OpenCLIP's location, or the folder itself
        ds = ImageNetV2Dataset(root, image_transform(16, is_train=False))
        assert ds.labels == [0, 0, 2, 2, 10, 10, 999, 999]  # numeric, not lexicographic (10 after 2)
        assert ds.classnames == names and len(names) == 1000  # every class competes, as in OpenCLIP
        assert ds[6][0].shape == (3, 16, 16) and ds[6][1] == 999
    (folder / "n01440764").mkdir()
    with pytest.raises(ValueError, match="expected class folders 0..999"):
        ImageNetV2Dataset(tmp_path, image_transform(16, is_train=False))


def test_imagenet_v2_zeroshot_is_reported_under_openclips_name(tmp_path):
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n")
    c = cfg(imagenet_v2=str(tmp_path), zeroshot_templates=str(tmp_path / "t.txt"), workers=0)
    tok = build_tokenizer(c.data, 16, tmp_path)
    torch.manual_seed(0)
    model = create_model("tiny", vocab_size=tok.vocab_size, context_length=16).eval()
    # Independent reference: rank the 1000 ImageNet classes (WordNet-id order) for each image by hand, then
    # file image 0 under its best class (a top-1 hit), image 1 under its 3rd (top-5 only), image 2 under its
    # 7th (a miss): only the folder number -> class index mapping OpenCLIP uses gives top1 1/3, top5 2/3.
    images = [Image.new("RGB", (40, 40), (60 * k, 200 - 50 * k, 30 * k)) for k in range(3)]
    names = list(imagenet_classnames().values())
    with torch.no_grad():
        img = model.encode_image(torch.stack([image_transform(32, is_train=False)(im) for im in images]))
        txt = model.encode_text(tok([f"a photo of a {n}." for n in names]))
        ranks = (nn.functional.normalize(img, dim=-1) @ nn.functional.normalize(txt, dim=-1).T).argsort(1, True)
    root = tmp_path / "ImageNetV2-matched-frequency"
    for k, place in enumerate((0, 2, 6)):
        (root / str(int(ranks[k, place]))).mkdir(parents=True, exist_ok=True)
        images[k].save(root / str(int(ranks[k, place])) / f"{k}.png")  # lossless: the ranks stay exact
    ev = Evaluator(c.data, tokenizer=tok, image_size=32, batch_size=64, device=torch.device("cpu"))
    assert ev.has_zeroshot
    out = ev.zeroshot(model)
    assert out == pytest.approx({"imagenetv2-zeroshot-val-top1": 1 / 3, "imagenetv2-zeroshot-val-top5": 2 / 3})


def test_dsclip_eval_takes_imagenet_v2_too(tmp_path):
    import json

    from dsclip.eval.cli import main_eval
    from dsclip.model.weights import save_model

    _v2_folder(tmp_path / "v2", [4, 8])
    (tmp_path / "t.txt").write_text("a {c}.\n")
    save_model(create_model("tiny", vocab_size=256), tmp_path / "m")
    results = tmp_path / "r.jsonl"
    argv = ["--model", str(tmp_path / "m"), "--imagenet-v2", str(tmp_path / "v2"), "--device", "cpu"]
    argv += ["--zeroshot-templates", str(tmp_path / "t.txt"), "--workers", "0", "--results", str(results)]
    assert main_eval(argv) == 0
    rec = json.loads(results.read_text())
    assert rec["imagenet_v2"] == str(tmp_path / "v2")
    assert set(rec["metrics"]) == {"imagenetv2-zeroshot-val-top1", "imagenetv2-zeroshot-val-top5"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
