"""End to end: a saved (untrained) demo model through ``dsclip eval`` (main_eval) on demo data."""

import json

import pytest

from dsclip.data.demo import DemoDataset, write_demo_classfolder
from dsclip.data.tools import write_shards
from dsclip.eval.cli import main_eval


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
    assert (
        main_eval(["--model", str(saved_model), "--zeroshot-data", str(tmp_path / "nope"), "--device", "cpu"])
        == 2
    )
    assert main_eval(["--model", str(tmp_path / "nomodel"), "--zeroshot-data", "demo"]) == 2
    assert capsys.readouterr().err.count("dsclip eval: error:") == 3
