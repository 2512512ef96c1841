import io
import json
import tarfile

import pytest
import torch
from PIL import Image

from dsclip.data import DataConfig, build_train_data
from dsclip.data.shards import ShardError
from dsclip.data.tokenizer import TRUNCATED


class IdTokenizer:
    """Caption "sample <id>" -> row [id, -1]: lets a test recover which samples a batch holds."""

    eos_id, pad_id, vocab_size = -1, -2, 10**6

    def __call__(self, texts):
        return torch.tensor([[int(t.split()[-1]), -1] for t in texts])


class CountingIdTokenizer(IdTokenizer):
    """IdTokenizer that reports a caption as cut when its words + EOS exceed a context of 3 (what
    SentencePieceTokenizer.tokenize_counting reports for pieces): "sample <id>" fits, longer ones are cut."""

    context_length = 3

    def __call__(self, texts):
        return torch.tensor([[int(t.split()[1]), -1] for t in texts])

    def tokenize_counting(self, texts):
        return self(texts), sum(len(t.split()) + 1 > self.context_length for t in texts)


def _fmt(i: int) -> str:
    return "webp" if i % 5 == 0 else "png" if i % 3 == 0 else "jpg"


def _jpeg(i: int, size: int = 24) -> bytes:
    img = Image.new("RGB", (size + i % 5, size), ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256))
    buf = io.BytesIO()
    img.save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[_fmt(i)])
    return buf.getvalue()


def _add(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_shards(root, n_shards, per_shard, *, corrupt=(), no_caption=(), json_caption=(), long_caption=(), start=0):
    """Shards root/shard-{k:03d}.tar with samples "sample <id>"; ids listed in corrupt/no_caption are bad;
    ids in long_caption get "sample <id> and more words" (longer than CountingIdTokenizer's context)."""
    root.mkdir(parents=True, exist_ok=True)
    i = start
    sizes = {}
    for k in range(n_shards):
        path = root / f"shard-{k:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(per_shard):
                key = f"{i:06d}"
                img = _jpeg(i)
                ext = _fmt(i)
                if i in corrupt:
                    img = img[: len(img) // 3] + b"garbage"
                _add(tar, f"{key}.{ext}", img)
                if i in json_caption:
                    _add(tar, f"{key}.json", json.dumps({"caption": f"sample {i}"}).encode())
                elif i in long_caption:
                    _add(tar, f"{key}.txt", f"sample {i} and more words".encode())
                elif i not in no_caption:
                    _add(tar, f"{key}.txt", f"sample {i}".encode())
                i += 1
        sizes[path.name] = per_shard
    (root / "sizes.json").write_text(json.dumps(sizes))
    return str(root / f"shard-{{000..{n_shards - 1:03d}}}.tar")


def _epoch(td, epoch, start=0):
    out = []
    for images, tokens in td.batches(epoch, start):
        assert images.shape[0] == td.batch_size and tokens.shape[0] == td.batch_size
        out.append(tokens[:, 0].tolist())
    return out


def _build(pattern, rank=0, world=2, batch=5, workers=0, tokenizer=None, **kw):
    cfg = DataConfig(train_data=pattern, workers=workers, shuffle_buffer=kw.pop("shuffle_buffer", 8), **kw)
    return build_train_data(
        cfg,
        tokenizer=tokenizer or IdTokenizer(),
        image_size=16,
        batch_size=batch,
        rank=rank,
        world_size=world,
        seed=kw.get("seed", 0) or 0,
    )


def test_every_sample_once_disjoint_ranks(tmp_path):
    pattern = make_shards(tmp_path / "d", 4, 10)
    tds = [_build(pattern, rank=r) for r in range(2)]
    assert tds[0].steps_per_epoch == 4 and tds[0].num_samples == 40  # from sizes.json
    ids = [sum(_epoch(td, 0), []) for td in tds]
    assert not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(40))
    # deterministic per (seed, epoch), different across epochs
    assert sum(_epoch(tds[0], 0), []) == ids[0]
    assert sum(_epoch(tds[0], 1), []) != ids[0]


def test_rank_worker_slots_cover_epoch_once(tmp_path):
    pattern = make_shards(tmp_path / "d", 8, 5)  # 2 ranks x 2 workers = 4 slots, 2 shards each
    ids = []
    for r in range(2):
        td = _build(pattern, rank=r, workers=2)
        try:
            ids += sum(_epoch(td, 0), [])
        finally:
            td.close()
    assert sorted(ids) == list(range(40))


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_disjoint_and_resume(tmp_path, workers):
    pattern = make_shards(tmp_path / "d", 4, 10)  # 2 ranks x 2 workers = 4 slots = 4 shards
    td = _build(pattern, rank=1, workers=workers)
    try:
        full = _epoch(td, 3)
        assert len(full) == 4 and len(set(sum(full, []))) == 20
        for start in (1, 3, 4):
            assert _epoch(td, 3, start) == full[start:]
    finally:
        td.close()


def test_uneven_shards_equal_batches_no_early_end(tmp_path):
    a = make_shards(tmp_path / "a", 1, 23)
    b = make_shards(tmp_path / "b", 2, 4, start=100)  # rank 1 gets much less data: it must repeat, not stop
    spec = f"{a}::{b}"
    tds = [_build(spec, rank=r, train_num_samples=40) for r in range(2)]
    counts = [len(_epoch(td, 0)) for td in tds]
    assert counts == [4, 4]


def test_resampled_and_upsampling(tmp_path):
    a = make_shards(tmp_path / "a", 2, 10)
    b = make_shards(tmp_path / "b", 2, 10, start=1000)
    td = _build(
        f"{a}::{b}",
        world=1,
        batch=10,
        dataset_resampled=True,
        train_data_upsampling_factors="1::9",
        train_num_samples=400,
    )
    ids = sum(_epoch(td, 0), [])
    assert len(ids) == 400
    frac_b = sum(i >= 1000 for i in ids) / len(ids)
    assert frac_b > 0.75
    with pytest.raises(ShardError, match="needs --dataset-resampled"):
        _build(f"{a}::{b}", train_data_upsampling_factors="1::2", train_num_samples=10)


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_data_skipped_and_counted(tmp_path, workers):
    make_shards(tmp_path / "d", 2, 12, corrupt={3, 15}, no_caption={5}, json_caption={7})
    d = tmp_path / "d"
    # truncate the second shard mid-file, add an unreadable (non-tar) shard
    raw = (d / "shard-001.tar").read_bytes()
    (d / "shard-001.tar").write_bytes(raw[: len(raw) * 2 // 3])
    (d / "shard-002.tar").write_bytes(b"this is not a tar file" * 100)
    spec = str(d / "shard-{000..002}.tar")
    td = _build(spec, world=1, batch=4, train_num_samples=16, workers=workers)
    try:
        ids = sum(_epoch(td, 0), [])
    finally:
        td.close()
    # 7's caption sits in .json only: OpenCLIP main's default --text-key txt without --json-text-key drops it
    assert len(ids) == 16 and 5 not in ids and 3 not in ids and 7 not in ids
    st = td.stats()
    assert st["missing_caption"] >= 1 and st["corrupt_image"] >= 1
    assert st.get("truncated_tar", 0) >= 1 and st.get("unreadable_shard", 0) >= 1


@pytest.mark.parametrize("workers", [0, 2])
def test_captions_cut_by_the_context_length_are_counted(tmp_path, workers):
    # issue 15 item 5 on the webdataset path: every sample of an epoch is trained on once, so the count of
    # cut captions is exactly the long ones, whichever worker decoded them; a resume counts only its steps
    long = {1, 4, 9, 13, 22}
    pattern = make_shards(tmp_path / "d", 2, 12, long_caption=long)
    td = _build(pattern, world=1, batch=4, train_num_samples=24, workers=workers, tokenizer=CountingIdTokenizer())
    try:
        batches = _epoch(td, 0)
        assert sorted(sum(batches, [])) == list(range(24))
        assert td.stats() == {TRUNCATED: len(long)}
        resumed = _build(
            pattern, world=1, batch=4, train_num_samples=24, workers=workers, tokenizer=CountingIdTokenizer()
        )
        try:
            assert _epoch(resumed, 0, start=4) == batches[4:]
            assert resumed.stats().get(TRUNCATED, 0) == len(long & set(sum(batches[4:], [])))
        finally:
            resumed.close()
    finally:
        td.close()


def test_spec_errors(tmp_path):
    make_shards(tmp_path / "d", 2, 4)
    with pytest.raises(ShardError, match="shard not found"):
        _build(str(tmp_path / "d" / "shard-{000..005}.tar"), train_num_samples=10)
    with pytest.raises(ShardError, match="empty"):
        _build("  ", dataset_type="webdataset", train_num_samples=10)
    with pytest.raises(ShardError, match="train-num-samples"):
        (tmp_path / "d" / "sizes.json").unlink()
        _build(str(tmp_path / "d" / "shard-{000..001}.tar"))


def _png(size, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_captions_and_odd_image_sizes_are_skipped_and_counted(tmp_path, workers):
    # issue 32: a Latin-1 caption trained on replacement characters, 1x1 and 8000x8000 images passed, all uncounted
    d = tmp_path / "odd"
    d.mkdir()
    odd = {3: ("latin1", None), 6: ("tiny", (1, 1)), 9: ("huge", (8000, 8000))}  # sample id -> what, image size
    with tarfile.open(d / "shard-000.tar", "w") as tar:
        for i in range(16):
            what, size = odd.get(i, (None, None))
            # the 8000x8000 one in 1-bit mode: an 8 KB file (only its header is read before it is skipped)
            _add(tar, f"{i:06d}.png", _png(size, "1" if what == "huge" else "RGB") if size else _jpeg(i))
            caption = f"caf\u00e9 {i}" if what == "latin1" else f"sample {i}"
            _add(tar, f"{i:06d}.txt", caption.encode("latin-1" if what == "latin1" else "utf-8"))
    td = _build(str(d / "shard-000.tar"), world=1, batch=4, train_num_samples=16, workers=workers, shuffle_buffer=0)
    try:
        ids = sum(_epoch(td, 0), [])
    finally:
        td.close()
    assert not {3, 6, 9} & set(ids) and len(ids) == 16
    st = td.stats()
    assert st["undecodable_caption"] >= 1 and st["small_image"] >= 1 and st["large_image"] >= 1, st
    # the limits are flags: 0 turns them off, and the images train
    td = _build(str(d / "shard-000.tar"), world=1, batch=4, train_num_samples=16, workers=0, shuffle_buffer=0,
                min_image_size=0, max_image_size=0)  # fmt: skip
    try:
        ids = sum(_epoch(td, 0), [])
    finally:
        td.close()
    assert {6, 9} <= set(ids) and "small_image" not in td.stats() and "large_image" not in td.stats()
