"""End to end: a saved (untrained) demo model through ``dsclip eval`` (main_eval) on demo data."""

import json

import pytest

from dsclip.data.demo import DemoDataset, write_demo_classfolder
from dsclip.data.tools import write_shards
from dsclip.eval.cli import main_eval
from tests.tolerances import embedding_tol


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from dsclip.model import create_model
    from dsclip.model.weights import save_model

    d = tmp_path_factory.mktemp("model")
    model = create_model("tiny", vocab_size=256)  # argmax pooling: fine for a smoke test
    save_model(model, d)
    return d


def test_eval_zeroshot_and_retrieval(tmp_path, saved_model, capsys):
    folder = write_demo_classfolder(tmp_path / "zs", 21)
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n# comment\na {c}.\n")
    ds = DemoDataset.heldout(12, 32)
    from PIL import Image

    (tmp_path / "img").mkdir()
    samples = []
    for i in range(12):
        p = tmp_path / "img" / f"{i}.png"
        Image.fromarray(ds.render(i)).save(p)
        samples.append((str(p), ds.caption(i)))
    write_shards(samples, tmp_path / "val", shard_size=5)
    results = tmp_path / "r" / "results.jsonl"
    argv = [
        "--model",
        str(saved_model),
        "--zeroshot-data",
        folder,
        "--zeroshot-templates",
        str(tmp_path / "t.txt"),
        "--val-data",
        str(tmp_path / "val" / "shard-{00000..00002}.tar"),
        "--workers",
        "0",
        "--batch-size",
        "8",
        "--results",
        str(results),
        "--device",
        "cpu",
    ]
    assert main_eval(argv) == 0
    rec = json.loads(results.read_text().splitlines()[-1])
    m = rec["metrics"]
    assert 0 <= m["zeroshot-top1"] <= m["zeroshot-top5"] <= 1
    assert m["num_images"] == 12 and 1 <= m["image_to_text_mean_rank"] <= 12
    assert (
        main_eval(
            [
                "--model",
                str(saved_model),
                "--zeroshot-data",
                "demo",
                "--demo-eval-samples",
                "20",
                "--results",
                str(results),
                "--device",
                "cpu",
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert len(results.read_text().splitlines()) == 2
    assert "zeroshot-top1" in capsys.readouterr().out


def test_eval_errors(tmp_path, saved_model, capsys):
    assert main_eval(["--model", str(saved_model)]) == 2
    assert main_eval(["--model", str(saved_model), "--zeroshot-data", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert main_eval(["--model", str(tmp_path / "nomodel"), "--zeroshot-data", "demo"]) == 2
    assert capsys.readouterr().err.count("dsclip eval: error:") == 3


def test_eval_openclip_pretrained_matches_openclip_embeddings(tmp_path):
    """`dsclip eval --model ARCH --pretrained openclip.pt`: an OpenCLIP training checkpoint (module. prefix)."""
    import open_clip
    import torch

    from dsclip.eval.cli import _load_openclip_pretrained
    from dsclip.model import get_model_config, openclip_model_config

    torch.manual_seed(0)
    oc = open_clip.CLIP(**openclip_model_config(get_model_config("tiny"))["model_cfg"]).eval()
    ckpt = tmp_path / "epoch_1.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in oc.state_dict().items()}}, ckpt)
    model = _load_openclip_pretrained("tiny", str(ckpt), "cpu")
    images, tokens = torch.randn(3, 3, 32, 32), torch.randint(1, 999, (3, 32))
    tol = embedding_tol(get_model_config("tiny"))  # same weights, other modules: forward rounding, unit vectors
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_image(images), oc.encode_image(images, normalize=True), atol=tol, rtol=0
        )
        torch.testing.assert_close(model.encode_text(tokens), oc.encode_text(tokens, normalize=True), atol=tol, rtol=0)
    results = tmp_path / "results.jsonl"
    argv = [
        "--model",
        "tiny",
        "--pretrained",
        str(ckpt),
        "--zeroshot-data",
        "demo",
        "--demo-eval-samples",
        "16",
        "--workers",
        "0",
        "--results",
        str(results),
        "--device",
        "cpu",
    ]
    assert main_eval(argv) == 0
    assert "zeroshot-top1" in json.loads(results.read_text().splitlines()[-1])["metrics"]
