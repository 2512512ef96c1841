"""--remote-sync's logic against a real S3-compatible server (SeaweedFS on localhost: tests/s3_server.py):
what is uploaded and in which order, --keep-last remotely, the newest complete remote tag for a resume, and
a remote that fails. Tags here are made by the real manifest code with small shard files (the sync never
reads a shard's contents; the e2e test tests/e2e/test_remote_sync_cli.py syncs and resumes real ones)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from dsclip.checkpoint import manifest
from dsclip.checkpoint.ds_checkpoint import atomic_write, tag_for_step
from dsclip.checkpoint.layout import COMPLETE, DIVERGED, LATEST, MANIFEST
from dsclip.checkpoint.remote_resume import fetch_newest, prepare_run
from dsclip.checkpoint.remote_store import Store, open_store
from dsclip.checkpoint.remote_sync import RemoteSync, RemoteSyncArgs
from dsclip.config_base import ConfigError


def make_tag(run: Path, step: int, *, latest: bool = True) -> Path:
    """A complete tag as the Checkpointer leaves it: shards, COMPLETE, MANIFEST.json (last), ``latest``."""
    ckpt = run / "checkpoints"
    tag = ckpt / tag_for_step(step)
    (tag / "zero").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(os.urandom(3000 + step))
    (tag / "zero" / "optim_states.pt").write_bytes(os.urandom(5000))
    atomic_write(tag / COMPLETE, json.dumps({"step": step, "manifest": MANIFEST}))
    atomic_write(tag / MANIFEST, manifest.build(tag))
    if latest:
        atomic_write(ckpt / LATEST, tag.name)
    return tag


class Recording(Store):
    """The real store, with the order of its uploads kept."""

    def __init__(self, store: Store):
        super().__init__(store.fs, store.root, store.url)
        self.puts: list[str] = []

    def put(self, local, rel):
        super().put(local, rel)
        self.puts.append(rel)


def _syncer(run: Path, store: Store, keep_last: int = 0, lines: list | None = None) -> RemoteSync:
    return RemoteSync(run, store, frequency=3600, keep_last=keep_last, say=(lines if lines is not None else []).append)


def test_sync_uploads_logs_and_complete_tags_marker_last_and_keeps_last_remotely(tmp_path, s3_bucket):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "out.log").write_text("line 1\n")
    (run / ".lock").write_text("host pid")
    (run / "tb").mkdir()
    (run / "tb" / "events.1").write_bytes(b"x" * 10)
    make_tag(run, 1)
    make_tag(run, 2)
    (run / "checkpoints" / ".partial.step_000000003").mkdir()  # a save in progress
    (run / "checkpoints" / ".partial.step_000000003" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (run / "checkpoints" / "step_000000009").mkdir()  # no COMPLETE: never a tag
    (run / "checkpoints" / "step_000000009" / "x.pt").write_bytes(b"x")
    store = Recording(open_store(f"s3://{s3_bucket}/runs", "s3", "r1"))
    sync = _syncer(run, store, keep_last=2)
    assert sync.sync_once()

    remote = store.files("")
    assert set(remote) == {
        "out.log", "tb/events.1", "checkpoints/latest",
        *(f"checkpoints/{t}/{f}" for t in ("step_000000001", "step_000000002")
          for f in ("mp_rank_00_model_states.pt", "zero/optim_states.pt", COMPLETE, MANIFEST)),
    }  # fmt: skip
    # each tag's files first, then its manifest, then COMPLETE: a tag is complete remotely only when it is
    for tag in ("step_000000001", "step_000000002"):
        mine = [p for p in store.puts if p.startswith(f"checkpoints/{tag}/")]
        assert mine[-2:] == [f"checkpoints/{tag}/{MANIFEST}", f"checkpoints/{tag}/{COMPLETE}"]
    assert store.read_text("checkpoints/latest") == "step_000000002"

    # the next save (step 3) and the local --keep-last 2 removing step 1: remotely too, once step 3 is complete
    (run / "out.log").write_text("line 1\nline 2\n")
    n_puts = len(store.puts)
    make_tag(run, 3)
    shutil.rmtree(run / "checkpoints" / "step_000000001")
    assert sync.sync_once()
    assert store.complete_tags() == ["step_000000002", "step_000000003"]
    assert store.files("checkpoints/step_000000001") == {}  # (SeaweedFS lists the empty folder: no file is left)
    assert (
        store.read_text("out.log") == "line 1\nline 2\n" and store.read_text("checkpoints/latest") == "step_000000003"
    )
    # unchanged files and tags already complete remotely are not uploaded again
    assert sorted(store.puts[n_puts:]) == sorted(
        ["out.log", *(f"checkpoints/step_000000003/{f}" for f in ("mp_rank_00_model_states.pt",
                                                                   "zero/optim_states.pt", COMPLETE, MANIFEST))]
    )  # fmt: skip

    # --keep-last 1 remotely, but the local folder still keeps step 2 (the confirmed tag the Checkpointer holds
    # back while step 4 is unconfirmed): so does the remote
    sync.keep_last = 1
    shutil.rmtree(run / "checkpoints" / "step_000000003")
    make_tag(run, 4)
    assert sync.sync_once()
    assert store.complete_tags() == ["step_000000002", "step_000000004"]
    # the run diverged after step 4: its DIVERGED marker and latest moved back to step 2 follow
    atomic_write(run / "checkpoints" / tag_for_step(4) / DIVERGED, json.dumps({"first_bad_step": 5}))
    atomic_write(run / "checkpoints" / LATEST, "step_000000002")
    assert sync.sync_once()
    assert store.exists(f"checkpoints/step_000000004/{DIVERGED}")
    assert store.read_text("checkpoints/latest") == "step_000000002"


def test_resaved_tag_is_not_complete_remotely_while_its_files_change(tmp_path, s3_bucket):
    run = tmp_path / "r"
    tag = make_tag(run, 5)
    store = open_store(f"s3://{s3_bucket}", "s3", "r")
    sync = _syncer(run, store)
    assert sync.sync_once()
    # the tag saved again (a preempted run re-saving the step it resumed from): its upload starts by taking
    # COMPLETE away, so an upload that fails half-way leaves no complete-looking mix of old and new files
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"new weights")
    atomic_write(tag / MANIFEST, manifest.build(tag))

    class Refusing(Store):
        def put(self, local, rel):
            if rel.endswith("mp_rank_00_model_states.pt"):
                raise PermissionError("Access Denied")
            super().put(local, rel)

    sync.store = Refusing(store.fs, store.root, store.url)
    sync.tag_complete(tag)
    assert not sync.sync_once()
    assert store.complete_tags() == []
    sync.store = store  # the next tick uploads it again
    assert sync.sync_once()
    assert store.complete_tags() == ["step_000000005"]
    assert store.fs.cat_file(store.path("checkpoints/step_000000005/mp_rank_00_model_states.pt")) == b"new weights"


def test_resume_takes_the_newest_complete_remote_tag_that_verifies(tmp_path, s3_bucket):
    run = tmp_path / "r"
    for step in (1, 2, 3):
        make_tag(run, step)
    store = open_store(f"s3://{s3_bucket}/p", "s3", "r")
    lines: list[str] = []
    assert _syncer(run, store, lines=lines).sync_once(), lines
    want = (run / "checkpoints/step_000000001/mp_rank_00_model_states.pt").read_bytes()
    # step 3's upload never finished (no COMPLETE: the remote latest names it all the same), step 2 was damaged
    # in the store (same size, other bytes): the resume takes step 1, verified, and says why not the others
    store.rm("checkpoints/step_000000003/COMPLETE")
    bad = store.path("checkpoints/step_000000002/zero/optim_states.pt")
    store.fs.pipe_file(bad, bytes(5000))
    fresh = tmp_path / "fresh" / "checkpoints"
    assert fetch_newest(store, fresh, say=lines.append) == "step_000000001"
    assert (fresh / LATEST).read_text() == "step_000000001"
    assert (fresh / "step_000000001/mp_rank_00_model_states.pt").read_bytes() == want
    assert manifest.verify(fresh / "step_000000001").ok
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step_000000001"]  # no download left behind
    assert len(lines) == 2 and "step_000000002 skipped: zero/optim_states.pt is corrupt" in lines[0], lines
    assert "downloaded" in lines[1] and "step_000000001" in lines[1]

    # prepare_run: the same for --resume latest with an empty run folder; without --resume a remote holding
    # this run's checkpoints is refused (as a local one), --overwrite deletes them
    other = tmp_path / "other"
    args = RemoteSyncArgs(remote_sync=f"s3://{s3_bucket}/p")
    assert prepare_run(args, other, "r", resume="latest", overwrite=False) is not None
    assert (other / "checkpoints/latest").read_text() == "step_000000001"
    with pytest.raises(ConfigError, match="already holds checkpoints.*--resume latest"):
        prepare_run(args, tmp_path / "new", "r", resume=None, overwrite=False)
    prepare_run(args, tmp_path / "new", "r", resume=None, overwrite=True)
    assert store.complete_tags() == []
    assert fetch_newest(store, tmp_path / "empty", say=lines.append) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_unreachable_or_refusing_remote_is_one_line_and_the_run_ends(tmp_path, s3_bucket, monkeypatch):
    run = tmp_path / "r"
    make_tag(run, 1)
    (run / "out.log").write_text("x\n")
    lines: list[str] = []
    # a bucket that does not exist: the store refuses every write
    missing = f"s3://no-such-bucket-{os.getpid()}/p"
    sync = _syncer(run, open_store(missing, "s3", "r"), lines=lines).start()
    sync.tag_complete(run / "checkpoints" / "step_000000001")
    assert not sync.close()
    assert not sync._thread.is_alive()
    assert len(lines) == 2, lines
    assert "remote sync to s3://" in lines[0] and "failed (" in lines[0] and "training goes on" in lines[0]
    assert "did not complete" in lines[1] and str(run) in lines[1]

    # unreachable (nothing listens): one line for any number of failed ticks, one when it works again
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    lines.clear()
    down = open_store(f"s3://{s3_bucket}", "s3", "r")
    sync = _syncer(run, down, lines=lines)
    assert not sync.sync_once() and not sync.sync_once()
    assert len(lines) == 1 and "Could not connect" in lines[0], lines
    monkeypatch.setenv("AWS_ENDPOINT_URL", os.environ["FSSPEC_S3_ENDPOINT_URL"])
    sync.store = open_store(f"s3://{s3_bucket}", "s3", "r")
    assert sync.close()
    assert "works again" in lines[1] and "synced to" in lines[2]
    assert sync.store.complete_tags() == ["step_000000001"]


def test_fsspec_protocol_syncs_to_any_fsspec_url(tmp_path):
    run = tmp_path / "r"
    make_tag(run, 7)
    (run / "metrics.jsonl").write_text("{}\n")
    store = open_store(f"file://{tmp_path / 'mirror'}", "fsspec", "r")
    assert _syncer(run, store).close()
    copy = tmp_path / "mirror" / "r"
    assert (copy / "metrics.jsonl").read_text() == "{}\n"
    assert manifest.verify(copy / "checkpoints" / "step_000000007").ok
    assert fetch_newest(store, tmp_path / "back", say=lambda m: None) == "step_000000007"


@pytest.mark.parametrize(
    "args, error",
    [
        (dict(remote_sync="gs://b/p"), "--remote-sync-protocol s3 takes an s3://bucket/path URL"),
        (dict(remote_sync="/local/path", remote_sync_protocol="fsspec"), "not a URL"),
        (dict(remote_sync="s3://b", remote_sync_frequency=0), "--remote-sync-frequency must be > 0"),
    ],
)
def test_bad_remote_sync_flags_are_one_line(args, error):
    with pytest.raises(ConfigError, match=error):
        RemoteSyncArgs(**args).check()
