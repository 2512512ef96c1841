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


def test_latin1_csv_is_one_line_naming_file_line_and_fix(tmp_path):
    # issue 32: a Latin-1 table was "'utf-8' codec can't decode byte 0xe9 in position 1963", no file, no row
    from dsclip.data.csv_data import read_csv

    path = tmp_path / "caf.csv"
    path.write_bytes("filepath,title\na.png,ok\nb.png,caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        read_csv(path, "filepath", "title", ",")
    msg = str(e.value)
    assert "\n" not in msg and f"{path}: line 3, column 10: byte 0xe9 is not UTF-8" in msg
    assert "iconv -f latin1 -t utf-8" in msg
    # the converted file (and one with Excel's BOM) reads
    path.write_bytes("\ufefffilepath,title\na.png,ok\nb.png,caf\u00e9 au lait\n".encode("utf-8"))
    assert read_csv(path, "filepath", "title", ",")[1] == ["ok", "caf\u00e9 au lait"]


def test_csv_images_outside_the_size_limits_are_skipped_and_counted(tmp_path):
    path = _table(tmp_path, n=6)
    Image.new("RGB", (1, 1)).save(tmp_path / "img" / "2.png")  # a tracking pixel
    Image.new("RGB", (300, 40)).save(tmp_path / "img" / "4.png")  # longer side above --max-image-size 256
    cfg = DataConfig(train_data=path, workers=0, max_image_size=256)
    td = build_train_data(cfg, tokenizer=IdTokenizer(), image_size=16, batch_size=6, rank=0, world_size=1, seed=0)
    seen = [t for _, tokens in td.batches(0) for t in tokens[:, 0].tolist()]
    assert len(seen) == 6 and not {2, 4} & set(seen)
    assert td.stats()["small_image"] == 1 and td.stats()["large_image"] == 1
