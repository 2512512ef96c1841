"""--image-key / --text-key / --json-text-key (issue 66): OpenCLIP main's member choice and precedence, the
webdataset reader on shards with other suffixes, the start-up line for shards the keys do not match, and
`dsclip data write/inspect` with keys."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from PIL import Image
from webdataset.filters import getfirst

from dsclip.config import parse_run_config
from dsclip.data import DataConfig, build_train_data
from dsclip.data.sample_keys import SampleKeys
from dsclip.data.shards import ShardError
from dsclip.data.tools import _iter_captions, inspect_shards, main_data, main_tokenizer

from .test_data_wds import IdTokenizer

_PIL = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP", "tif": "TIFF"}


def _image(i: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 18), ((i * 37) % 256, (i * 91) % 256, 7)).save(buf, format=_PIL[fmt])
    return buf.getvalue()


def _shard(path, members_of, n: int = 6) -> str:
    """One shard of ``n`` samples; ``members_of(i)`` -> {suffix: bytes}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in members_of(i).items():
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _ids(spec: str, n: int, **keys) -> list[int]:
    cfg = DataConfig(train_data=spec, train_num_samples=n, workers=0, shuffle_buffer=0, **keys)
    td = build_train_data(cfg, tokenizer=IdTokenizer(), image_size=16, batch_size=n, rank=0, world_size=1, seed=0)
    try:
        (_, tokens), *_ = td.batches(0, 0)
        return sorted(tokens[:, 0].tolist())
    finally:
        td.close()


# -- member choice: the first listed suffix present, as webdataset's rename (what main calls) picks it ---------------
_SAMPLES = [
    {"jpg": b"J", "png": b"P", "txt": b"T", "cls": b"C"},
    {"webp": b"W", "jpeg": b"E", "cls": b"C"},
    {"png": b"P", "txt": b"", "cls": b"C"},
    {"tif": b"F", "json": b"{}"},
    {"jpg": b"J"},
]


@pytest.mark.parametrize("image_key", ["jpg;png;jpeg;webp", "png;jpg", "webp", "tif;jpg", " jpeg ; webp "])
@pytest.mark.parametrize("text_key", ["txt", "cls;txt", "txt;cls", "cls"])
def test_member_choice_is_webdatasets_first_present_key(image_key, text_key):
    keys = SampleKeys(image_key, text_key)
    for s in _SAMPLES:
        # main: wds.rename(image=image_key, text=text_key, keep=False) -> webdataset.filters.getfirst
        want_image = getfirst(s, image_key.replace(" ", ""), missing_is_error=False)
        want_text = getfirst(s, text_key, missing_is_error=False)
        assert keys.image(s) == want_image, (s, image_key)
        member = keys.text_member(s)
        assert (s[member] if member else None) == want_text, (s, text_key)
        # main's FilterNonEmptyText: an empty first member drops the sample, the next suffix is not tried
        assert keys.captions(s) == ([want_text.decode()] if want_text else []), (s, text_key)


def test_json_text_key_precedence_and_fields():
    meta = {"caption_a": "", "caption_b": " B ", "n": 3, "caption": "C", "alts": ["x ", "", "y"]}
    s = {"jpg": b"J", "txt": b"from txt", "json": json.dumps(meta).encode()}
    # --json-text-key takes precedence over --text-key: the txt member is not read even though present
    assert SampleKeys(text_key="txt", json_text_key="caption").captions(s) == ["C"]
    # ';'-separated fields: the first non-empty string wins; an empty or non-string field is skipped
    assert SampleKeys(json_text_key="caption_a;n;caption_b;caption").captions(s) == ["B"]
    assert SampleKeys(json_text_key="missing;caption_a").captions(s) == []
    # dsclip's addition: a list of strings is several captions
    assert SampleKeys(json_text_key="alts").captions(s) == ["x", "y"]
    # with --json-text-key a sample needs a .json: one with only a txt is dropped (main's FilterValidSample)
    assert SampleKeys(json_text_key="caption").captions({"jpg": b"J", "txt": b"t"}) == []
    assert SampleKeys(json_text_key="caption").captions({"jpg": b"J", "json": b"not json"}) == []
    # without it, .json is not a caption source (main's default --text-key txt)
    assert SampleKeys().captions({"jpg": b"J", "json": b'{"caption": "c"}'}) == []
    # dsclip keeps several lines of a text member as several captions
    assert SampleKeys(text_key="cls").captions({"cls": b"a\n\n b \n"}) == ["a", "b"]
    with pytest.raises(ValueError, match="--image-key ';' names no member suffix"):
        SampleKeys(image_key=";")


# -- the reader on shards whose members are not jpg/txt ------------------------------------------------------------
@pytest.mark.parametrize(
    "image_ext,text,keys",
    [
        ("jpg", "txt", {}),
        ("png", "cls", {"image_key": "png", "text_key": "cls"}),
        ("webp", "json", {"image_key": "webp", "json_text_key": "alt;caption"}),
        ("tif", "txt", {"image_key": "tif;jpg"}),
    ],
)
def test_reader_reads_shards_under_the_given_keys(tmp_path, image_ext, text, keys):
    def members(i):
        cap = f"sample {i}".encode()
        out = {image_ext: _image(i, image_ext)}
        if text == "json":  # alt empty on odd ids: the field after it in --json-text-key is used
            out["json"] = json.dumps({"alt": "" if i % 2 else f"sample {i}", "caption": f"sample {i}"}).encode()
        else:
            out[text] = cap
        return out

    spec = _shard(tmp_path / "s" / "a.tar", members)
    assert _ids(spec, 6, **keys) == list(range(6))


def test_text_key_alternatives_and_json_over_text_in_the_reader(tmp_path):
    # even ids: a .txt; odd ids: a .cls and a .json whose caption disagrees with the .cls
    def members(i):
        out = {"jpg": _image(i, "jpg"), "json": json.dumps({"caption": f"sample {100 + i}"}).encode()}
        out["txt" if i % 2 == 0 else "cls"] = f"sample {i}".encode()
        return out

    spec = _shard(tmp_path / "s" / "a.tar", members)
    assert _ids(spec, 6, text_key="txt;cls") == list(range(6))
    assert _ids(spec, 6, text_key="cls;txt", json_text_key="caption") == [100 + i for i in range(6)]


# -- start-up: one line naming the suffixes found and the flag --------------------------------------------------
def test_first_shard_matching_no_key_is_one_line_naming_the_flag(tmp_path):
    cls = _shard(tmp_path / "c" / "a.tar", lambda i: {"image": _image(i, "png"), "cls": str(i).encode()})
    with pytest.raises(ShardError) as e:
        _ids(cls, 6)
    msg = str(e.value)
    assert "\n" not in msg and "a.tar: no member matches --image-key jpg;png;jpeg;webp" in msg
    assert "(members found: .cls, .image)" in msg and "--image-key" in msg.split("pass ")[1]
    with pytest.raises(
        ShardError,
        match=r"no caption under --text-key txt \(members found: .cls, .image\); "
        r"pass --text-key cls$",
    ):
        _ids(cls, 6, image_key="image")
    assert _ids(cls, 6, image_key="image", text_key="cls") == list(range(6))  # "i" -> id i: the suggestion works

    tif = _shard(tmp_path / "t" / "a.tar", lambda i: {"tif": _image(i, "tif"), "txt": f"sample {i}".encode()})
    with pytest.raises(ShardError, match=r"members found: .tif, .txt\); pass --image-key tif$"):
        _ids(tif, 6)

    js = _shard(tmp_path / "j" / "a.tar", lambda i: {"jpg": _image(i, "jpg"), "json": b'{"caption": "c", "k": 1}'})
    with pytest.raises(ShardError, match=r"\(members found: .jpg, .json\); pass --json-text-key caption$"):
        _ids(js, 6)
    with pytest.raises(ShardError, match=r"no .json field alt holds a caption \(string fields found: caption\)"):
        _ids(js, 6, json_text_key="alt")
    with pytest.raises(ShardError, match="reads the .json member, and these samples have none"):
        _ids(tif, 6, image_key="tif", json_text_key="caption")


def test_train_accepts_the_key_flags():
    cfg = parse_run_config(["--name", "t", "--image-key", "tif", "--text-key", "cls;txt", "--json-text-key", "c"])
    assert (cfg.data.image_key, cfg.data.text_key, cfg.data.json_text_key) == ("tif", "cls;txt", "c")
    assert cfg.data.sample_keys() == SampleKeys("tif", "cls;txt", "c")


# -- dsclip data write / inspect --------------------------------------------------------------------------------
def test_data_write_and_inspect_with_keys(tmp_path, capsys):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(5):
        (imgs / f"{i}.jpg").write_bytes(_image(i, "jpg"))
        (imgs / f"{i}.txt").write_text(f"sample {i}")
    out = tmp_path / "s"
    argv = ["--images", str(imgs), "--out", str(out), "--image-key", "png", "--text-key", "cls"]
    assert main_data(argv + ["--json-text-key", "alt"]) == 0
    printed = capsys.readouterr().out
    assert "--image-key 'png' --text-key 'cls' --json-text-key 'alt'" in printed  # the train command reads them
    with tarfile.open(out / "shard-00000.tar") as t:
        names = t.getnames()
        assert Image.open(t.extractfile("000000000.png")).format == "PNG"  # re-encoded to what the key names
        assert json.loads(t.extractfile("000000000.json").read())["alt"] == "sample 0"
    assert sorted({n.split(".", 1)[1] for n in names}) == ["cls", "json", "png"]
    spec = str(out / "shard-00000.tar")
    # the reader with the same keys reads every sample; --text-key cls alone too (the same caption)
    assert _ids(spec, 5, image_key="png", json_text_key="alt") == list(range(5))
    assert _ids(spec, 5, image_key="png", text_key="cls") == list(range(5))

    assert main_data(["inspect", spec, "--image-key", "png", "--text-key", "cls"]) == 0
    assert "5 samples, 5 good" in capsys.readouterr().out
    rep = inspect_shards(spec)  # OpenCLIP's default keys: nothing matches, and the report says what to pass
    assert rep["total"]["good"] == 0 and rep["total"]["missing_caption"] == 5
    assert rep["shards"][0]["keys_hint"].endswith("pass --text-key cls or --json-text-key alt")
    assert main_data(["inspect", spec]) == 0
    assert "pass --text-key cls or --json-text-key alt" in capsys.readouterr().out
    assert main_data(["--images", str(imgs), "--out", str(tmp_path / "x"), "--text-key", "json"]) == 2
    assert "share the member .json" in capsys.readouterr().err
    # `dsclip tokenizer train --input SHARDS` reads the captions with the same keys
    alt = SampleKeys(json_text_key="alt")
    assert list(_iter_captions(spec, "title", "\t", alt)) == [f"sample {i}" for i in range(5)]
    assert list(_iter_captions(spec, "title", "\t")) == []  # no .txt member: nothing under the default key
    assert main_tokenizer(["train", "--input", spec, "--out", str(tmp_path / "t"), "--text-key", ";"]) == 2
    assert "--text-key ';' names no member suffix" in capsys.readouterr().err


def test_val_data_is_read_with_the_keys(tmp_path):
    from dsclip.eval.datasets import load_retrieval_set

    def members(i):  # png image + a .json whose "alt" holds two captions; a decoy .txt
        return {"png": _image(i, "png"), "txt": b"decoy", "json": json.dumps({"alt": [f"a{i}", f"b{i}"]}).encode()}

    spec = _shard(tmp_path / "v" / "a.tar", members, n=3)
    ds, captions, t2i = load_retrieval_set(spec, lambda im: im.size, keys=SampleKeys("png", json_text_key="alt"))
    assert captions == ["a0", "b0", "a1", "b1", "a2", "b2"] and t2i == [0, 0, 1, 1, 2, 2]
    assert [ds[i] for i in range(3)] == [(20, 18)] * 3  # the png members, read by offset
    with pytest.raises(ShardError, match=r"no member matches --image-key jpg \(members found: .json, .png, .txt\)"):
        load_retrieval_set(spec, lambda im: im, keys=SampleKeys("jpg"))
