import pytest
import torch
from PIL import Image

from dsclip.data import DataConfig, build_train_data
from tests.unit.test_data_wds import IdTokenizer


def _table(tmp_path, n=20, bad=(), empty=(), missing=()):
    (tmp_path / "img").mkdir()
    rows = ["filepath\ttitle"]
    for i in range(n):
        p = tmp_path / "img" / f"{i}.png"
        if i in bad:
            p.write_bytes(b"not an image")
        elif i not in missing:
            Image.new("RGB", (20, 30), (i * 10, 0, 0)).save(p)
        rows.append(f"img/{i}.png\t{'' if i in empty else f'sample {i}'}")
    (tmp_path / "data.tsv").write_text("\n".join(rows) + "\n")
    return str(tmp_path / "data.tsv")


def test_csv_epoch_ranks_and_bad_rows(tmp_path):
    path = _table(tmp_path, bad={4}, empty={7}, missing={9})
    cfg = DataConfig(train_data=path, workers=0)
    assert cfg.resolved_dataset_type() == "csv"
    tds = [
        build_train_data(cfg, tokenizer=IdTokenizer(), image_size=16, batch_size=3, rank=r, world_size=2, seed=0)
        for r in range(2)
    ]
    assert tds[0].steps_per_epoch == tds[1].steps_per_epoch == 3
    seen = []
    for td in tds:
        for images, tokens in td.batches(0):
            assert images.shape == (3, 3, 16, 16) and tokens.shape == (3, 2)
            seen += tokens[:, 0].tolist()
    assert not {4, 7, 9} & set(seen)
    stats = [td.stats() for td in tds]
    total = {k: sum(s.get(k, 0) for s in stats) for k in ("corrupt_image", "missing_caption", "missing_image")}
    assert sum(total.values()) >= 1  # whichever of the bad rows fell into the 18 used samples
    # resume exactness
    full = [t.clone() for _, t in tds[1].batches(1)]
    assert all(torch.equal(a, b) for a, b in zip([t for _, t in tds[1].batches(1, 2)], full[2:]))


def test_csv_errors(tmp_path):
    path = _table(tmp_path, n=4)
    with pytest.raises(ValueError, match="no column 'caption'"):
        build_train_data(
            DataConfig(train_data=path, csv_caption_key="caption"),
            tokenizer=IdTokenizer(),
            image_size=16,
            batch_size=2,
            rank=0,
            world_size=1,
            seed=0,
        )
    with pytest.raises(FileNotFoundError):
        build_train_data(
            DataConfig(train_data=str(tmp_path / "nope.csv")),
            tokenizer=IdTokenizer(),
            image_size=16,
            batch_size=2,
            rank=0,
            world_size=1,
            seed=0,
        )
