"""Issue 64: a webdataset resume replays the epoch on the shard index, so what it reads does not grow with its
position, and its batches are the uninterrupted run's."""

import gzip
import json
import os
import shutil

import pytest

from dsclip.data.tar_index import ShardChanged, find_index, index_paths
from dsclip.data.tools import main_data
from tests.unit.test_data_wds import _build, _epoch, make_shards


def _bad_data(tmp_path):
    """Two sources; bad rows of every kind spread over the shards: undecodable images, a missing caption, a
    Latin-1 caption, a truncated tar; a third, gzip-compressed source (no index: streamed)."""
    a = make_shards(tmp_path / "a", 6, 12, corrupt={3, 20, 41, 58}, no_caption={9, 30, 66}, json_caption={12})
    b = make_shards(tmp_path / "b", 3, 10, start=1000, corrupt={1004, 1017}, no_caption={1011})
    raw = (tmp_path / "b" / "shard-002.tar").read_bytes()
    (tmp_path / "b" / "shard-002.tar").write_bytes(raw[: len(raw) * 2 // 3])
    make_shards(tmp_path / "c", 1, 8, start=2000, corrupt={2003})
    gz = tmp_path / "c" / "shard-000.tar.gz"
    gz.write_bytes(gzip.compress((tmp_path / "c" / "shard-000.tar").read_bytes()))
    return f"{a}::{b}::{gz}"


@pytest.mark.parametrize("resampled", [False, True])
def test_resume_is_exact_at_world_2_with_2_workers_and_bad_data_skipped(tmp_path, resampled):
    spec = _bad_data(tmp_path)
    kw = dict(world=2, batch=4, workers=2, train_num_samples=80, shuffle_buffer=16)
    if resampled:
        kw.update(dataset_resampled=True, train_data_upsampling_factors="1::2::1")
    for rank in range(2):
        td = _build(spec, rank=rank, **kw)  # no index yet: the workers build them as they reach the shards
        try:
            full = _epoch(td, 0) + _epoch(td, 1)[:3]
            bad = td.stats()
        finally:
            td.close()
        assert len(full) == 13 and bad.get("corrupt_image", 0) + bad.get("missing_caption", 0) >= 1
        for start in (3, 9):  # a resumed run: a new loader, the indexes on disk now
            td = _build(spec, rank=rank, **kw)
            try:
                assert _epoch(td, 0, start) + _epoch(td, 1)[:3] == full[start:], (rank, start)
            finally:
                td.close()
    assert find_index(str(tmp_path / "a" / "shard-005.tar")).bad  # the bad rows are in the index
    assert find_index(str(tmp_path / "b" / "shard-002.tar")).end[0] == "truncated_tar"
    assert not os.path.exists(str(tmp_path / "c" / "shard-000.tar.gz.idx"))  # compressed: streamed


def _rchar() -> int:
    """Bytes this process has read through read(2)/pread(2), page cache or not (Linux's /proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"])


def _bytes_to_first_batch(spec, start, kw) -> int:
    before = _rchar()
    td = _build(spec, rank=1, **kw)
    try:
        next(iter(td.batches(0, start)))
    finally:
        td.close()
    return _rchar() - before - 4096  # the reading of /proc/self/io itself


def test_bytes_read_before_the_first_batch_do_not_grow_with_the_resume_position(tmp_path):
    spec = make_shards(tmp_path / "d", 20, 30, corrupt={100, 500}, no_caption={200, 510})
    assert main_data(["index", spec]) == 0  # as `dsclip data write` leaves them
    kw = dict(world=2, batch=5, workers=0, shuffle_buffer=8)
    data_bytes = sum(os.path.getsize(tmp_path / "d" / f"shard-{k:03d}.tar") for k in range(20))
    _bytes_to_first_batch(spec, 0, kw)  # warm up: lazy imports and PIL's plugins are read once
    fresh = _bytes_to_first_batch(spec, 0, kw)
    late = _bytes_to_first_batch(spec, 54, kw)  # 90 % of the rank's 60 steps
    # the main process reads the 20 index headers either way; a resume then reads the samples its buffer and
    # first batch take, as a fresh start does: nothing of the ~45 % of the data (rank 1's share) it passes
    assert late <= 1.5 * fresh + 4096, (late, fresh)
    assert late < 0.05 * data_bytes, (late, data_bytes)


def test_changed_shard_stops_with_one_line_and_data_index_rebuilds(tmp_path, capsys):
    spec = make_shards(tmp_path / "d", 4, 10)
    assert main_data(["index", spec]) == 0
    assert "indexed 4 shards (40 samples, 0 bad)" in capsys.readouterr().out
    shard = tmp_path / "d" / "shard-002.tar"
    with open(shard, "ab") as f:  # appended to after indexing: size and mtime differ
        f.write(b"\0" * 512)
    with pytest.raises(ShardChanged) as e:
        _build(spec, world=1, batch=5)
    msg = str(e.value)
    assert "\n" not in msg and str(shard) in msg and f"dsclip data index {shard}" in msg
    assert main_data(["index", spec]) == 0
    out = capsys.readouterr().out
    assert "indexed 1 shards" in out and "3 up to date" in out
    td = _build(spec, world=1, batch=5)
    try:
        assert sorted(sum(_epoch(td, 0), [])) == list(range(40))
    finally:
        td.close()


def test_index_goes_to_the_cache_when_the_shard_folder_is_read_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLIP_CACHE", str(tmp_path / "cache"))
    spec = make_shards(tmp_path / "d", 2, 10)
    shard = str(tmp_path / "d" / "shard-000.tar")
    beside, cached = index_paths(shard)
    beside.mkdir()  # squats the name: writing beside fails also for root, whom a read-only mode does not stop
    os.chmod(tmp_path / "d", 0o555)
    try:
        td = _build(spec, world=1, batch=5, workers=0)
        try:
            ids = sum(_epoch(td, 0), [])
        finally:
            td.close()
        assert sorted(ids) == list(range(20))
        assert cached.is_file() and find_index(shard).path == str(cached)
        head = json.loads(cached.read_bytes().split(b"\n", 1)[0])
        assert head["samples"] == 10 and head["shard"] == "shard-000.tar"
    finally:
        os.chmod(tmp_path / "d", 0o755)
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_resume_is_exact_with_fewer_shards_than_slots(tmp_path):
    # one shard, two ranks: every slot reads the shard and keeps every 2nd valid sample; the replay counts
    # the valid ones from the index as the stream did
    spec = make_shards(tmp_path / "d", 1, 40, corrupt={2, 17}, no_caption={5, 6, 30})
    for rank in range(2):
        full = _epoch(_build(spec, rank=rank, world=2, batch=4, train_num_samples=32), 0)
        for start in (1, 3):
            assert _epoch(_build(spec, rank=rank, world=2, batch=4, train_num_samples=32), 0, start) == full[start:]
