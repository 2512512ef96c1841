import io
import json
import tarfile

import numpy as np
import pytest

from dsclip.data import tools
from dsclip.data.demo import DemoDataset
from dsclip.data.tar_index import find_index
from dsclip.data.tokenizer import SentencePieceTokenizer
from dsclip.data.tools import inspect_shards, main_data, main_tokenizer, write_shards


def _demo_folder(root, n=30):
    from PIL import Image

    root.mkdir(parents=True)
    ds = DemoDataset(n, 32)
    for i in range(n):
        Image.fromarray(ds.render(i)).save(root / f"{i:04d}.png")
        (root / f"{i:04d}.txt").write_text(ds.caption(i))
    return ds


def _members(path):
    with tarfile.open(path) as t:
        return [(m.name, t.extractfile(m).read()) for m in t]


def test_write_inspect_from_folder(tmp_path, capsys):
    _demo_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "0005.png").write_bytes(b"broken")
    (tmp_path / "imgs" / "0007.txt").write_text("  ")
    assert main_data(["--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "s"), "--shard-size", "8"]) == 0
    sizes = json.loads((tmp_path / "s" / "sizes.json").read_text())
    assert sum(sizes.values()) == 28 and len(sizes) == 4  # rows 5 (corrupt) and 7 (no caption) skipped
    for name, count in sizes.items():  # each shard's index beside it, what a training resume replays on
        idx = find_index(str(tmp_path / "s" / name))
        assert idx.path == str(tmp_path / "s" / name) + ".idx" and idx.samples == count and not idx.bad
    assert main_data(["inspect", str(tmp_path / "s" / "shard-{00000..00003}.tar")]) == 0
    out = capsys.readouterr().out
    assert out.count("total: 4 shards, 28 samples, 28 good") == 1  # the report, once
    rep = inspect_shards(str(tmp_path / "s" / "shard-{00000..00003}.tar"))
    assert rep["shards"][0]["extensions"] == {"png": 8, "txt": 8, "json": 8}


def test_write_resumes_after_interrupt(tmp_path, monkeypatch):
    ds = _demo_folder(tmp_path / "imgs", 25)
    samples = [(str(tmp_path / "imgs" / f"{i:04d}.png"), ds.caption(i)) for i in range(25)]
    write_shards(samples, tmp_path / "ref", shard_size=6)
    real = tools._encode
    calls = {"n": 0}

    def flaky(path, resize, verify, *quality):
        calls["n"] += 1
        if calls["n"] == 15:
            raise KeyboardInterrupt
        return real(path, resize, verify, *quality)

    monkeypatch.setattr(tools, "_encode", flaky)
    with pytest.raises(KeyboardInterrupt):
        write_shards(samples, tmp_path / "out", shard_size=6)
    monkeypatch.setattr(tools, "_encode", real)
    assert len(list((tmp_path / "out").glob("shard-*.tar"))) == 2  # two complete shards survived
    r = write_shards(samples, tmp_path / "out", shard_size=6)
    assert r == {"shards": 5, "samples": 25, "skipped": 0}
    for name in sorted(p.name for p in (tmp_path / "ref").glob("shard-*.tar")):
        assert _members(tmp_path / "out" / name) == _members(tmp_path / "ref" / name)
    assert not list((tmp_path / "out").glob(".*.tmp"))
    with pytest.raises(tools.DataToolError, match="other options"):
        write_shards(samples, tmp_path / "out", shard_size=7)


def test_write_from_csv_resize_and_errors(tmp_path, capsys):
    ds = _demo_folder(tmp_path / "imgs", 6)
    rows = ["filepath,title"] + [f"imgs/{i:04d}.png,{ds.caption(i)}" for i in range(6)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    rc = main_data(
        [
            "write",
            "--csv",
            str(tmp_path / "d.csv"),
            "--csv-separator",
            ",",
            "--out",
            str(tmp_path / "s"),
            "--num-shards",
            "2",
            "--resize",
            "16",
        ]
    )
    assert rc == 0
    names = [n for n, _ in _members(tmp_path / "s" / "shard-00000.tar")]
    assert names[0].endswith(".jpg") and len(names) == 9
    assert main_data(["--images", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert main_data(["inspect", str(tmp_path / "s" / "missing-{0..3}.tar")]) == 2
    assert "error" in capsys.readouterr().err


def test_write_pre_resized_with_quality(tmp_path):
    """--resize N --quality Q (img2dataset's keep_ratio resize and encode_quality): shorter side N, RGB
    JPEGs (what nvJPEG takes), smaller at a lower quality; a quality outside 1..100 is refused."""
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    rng = np.random.default_rng(0)
    samples = []
    for i, mode in enumerate(("RGB", "CMYK", "L")):
        path = tmp_path / "imgs" / f"{i}.png" if mode != "CMYK" else tmp_path / "imgs" / f"{i}.jpg"
        Image.fromarray(rng.integers(0, 255, (120, 90 + 10 * i, 3), dtype=np.uint8)).convert(mode).save(path)
        samples.append((str(path), f"caption {i}"))
    sizes = {}
    for q in (95, 60):
        write_shards(samples, tmp_path / f"q{q}", resize=48, quality=q)
        members = dict(_members(tmp_path / f"q{q}" / "shard-00000.tar"))
        jpgs = [v for k, v in members.items() if k.endswith(".jpg")]
        assert len(jpgs) == 3
        for data in jpgs:
            img = Image.open(io.BytesIO(data))
            assert img.format == "JPEG" and img.mode == "RGB" and min(img.size) == 48
        sizes[q] = sum(map(len, jpgs))
    assert sizes[60] < 0.8 * sizes[95]
    with pytest.raises(tools.DataToolError, match="quality is 1..100"):
        write_shards(samples, tmp_path / "bad", resize=48, quality=0)


def test_tokenizer_train_cli(tmp_path, capsys):
    caps = tmp_path / "caps.txt"
    caps.write_text("\n".join(DemoDataset(300, 32).caption(i) for i in range(300)))
    rc = main_tokenizer(
        [
            "train",
            "--input",
            str(caps),
            "--out",
            str(tmp_path / "tok" / "spm"),
            "--vocab-size",
            "60",
            "--model-type",
            "bpe",
        ]
    )
    assert rc == 0 and "eos_id=2" in capsys.readouterr().out
    tok = SentencePieceTokenizer(tmp_path / "tok" / "spm.model", 16)
    assert tok.decode(tok(["a small red circle"])) == ["a small red circle"]
    assert main_tokenizer(["train", "--input", str(tmp_path / "none.txt"), "--out", str(tmp_path / "t2")]) == 2


def test_non_utf8_captions_are_counted_by_inspect_and_named_by_write(tmp_path, capsys):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    shard = tmp_path / "shard-00000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [("a.png", buf.getvalue()), ("a.txt", "caf\u00e9".encode("latin-1")),
                           ("b.png", buf.getvalue()), ("b.txt", b"fine")]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    total = inspect_shards(str(shard))["total"]
    assert total["good"] == 1 and total["undecodable_caption"] == 1
    # an image folder whose caption file is Latin-1: one line naming that file
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "imgs" / "x.png")
    (tmp_path / "imgs" / "x.txt").write_bytes("caf\u00e9".encode("latin-1"))
    assert main_data(["--images", str(tmp_path / "imgs"), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{tmp_path / 'imgs' / 'x.txt'}: line 1, column 4: byte 0xe9 is not UTF-8" in err
