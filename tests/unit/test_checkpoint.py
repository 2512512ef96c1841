"""Single-process checks of the checkpoint package: the save/prune protocol with a fake engine, tag
resolution, the streaming safetensors writer, and --pretrained loading (dsclip and OpenCLIP files)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from dsclip.checkpoint import ds_checkpoint as dc
from dsclip.checkpoint.convert import LazyTensor, find_checkpoint, write_safetensors_streaming
from dsclip.checkpoint.pretrained import load_pretrained_into
from dsclip.config import ConfigError
from dsclip.model import StateDictMismatchError, create_model, openclip_model_config, save_model
from tests.tolerances import embedding_tol

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class FakeEngine:
    """Writes what DeepSpeed would (one file per 'rank') and records the tags it was asked for."""

    def __init__(self):
        self.module = create_model("tiny", device="meta")
        self.tags = []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_text(json.dumps(client_state))
        (d / OPTIM).write_bytes(bytes(range(256)) * 16)  # a ZeRO optimizer shard (4 KiB)
        self.tags.append(tag)


def _ckpt(tmp_path, keep_last=0):
    return dc.Checkpointer(tmp_path, every_n_steps=2, every_n_epochs=0, keep_last=keep_last, rank=0)


def test_save_writes_partial_then_renames_complete_tag(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path)
    tag_dir = ck.save(engine, 2, {"step": 2})
    assert engine.tags == [".partial.step_000000002"]  # DeepSpeed never writes into a step_* folder
    assert tag_dir.name == "step_000000002"
    assert {p.name for p in tag_dir.iterdir()} == {
        "mp_rank_00_model_states.pt",
        OPTIM,
        dc.STATE_FILE,
        dc.COMPLETE,
        dc.MODEL_CONFIG_FILE,
        dc.MANIFEST,
    }
    assert json.loads((tag_dir / dc.MODEL_CONFIG_FILE).read_text())["model_cfg"]["embed_dim"] == 32
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000002"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_resave_of_latest_tag_and_leftovers(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path)
    ck.save(engine, 2, {"step": 2, "v": 1})
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".partial.step_000000004").mkdir()  # a save killed before COMPLETE
    (ckpts / ".trash.step_000000000").mkdir()  # a prune killed mid-delete
    ck.save(engine, 2, {"step": 2, "v": 2})  # e.g. preempted right after resuming at step 2
    assert json.loads((ckpts / "step_000000002" / dc.STATE_FILE).read_text())["v"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000002"]


def test_keep_last_prunes_only_older_complete_tags(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path, keep_last=2)
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        ck.save(engine, step, {"step": step})
    assert dc.complete_tags(ckpts) == ["step_000000004", "step_000000006"]
    (ckpts / "step_000000008").mkdir()  # an incomplete newer folder is never picked
    assert dc.latest_complete(ckpts) == "step_000000006"
    (ckpts / "latest").write_text("step_000000008")  # pointer to an incomplete tag: fall back
    assert dc.latest_complete(ckpts) == "step_000000006"


def test_find_checkpoint_accepts_run_ckpts_and_tag_dirs_and_refuses_incomplete(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path)
    ck.save(engine, 2, {"step": 2})
    ck.save(engine, 4, {"step": 4})
    ckpts = tmp_path / "checkpoints"
    assert find_checkpoint(tmp_path) == (ckpts, "step_000000004")
    assert find_checkpoint(ckpts) == (ckpts, "step_000000004")
    assert find_checkpoint(ckpts / "step_000000002") == (ckpts, "step_000000002")
    assert find_checkpoint(tmp_path, "step_000000002") == (ckpts, "step_000000002")
    (ckpts / "step_000000004" / dc.COMPLETE).unlink()
    with pytest.raises(ConfigError, match="incomplete"):
        find_checkpoint(ckpts / "step_000000004")
    with pytest.raises(ConfigError, match="incomplete.*step_000000002"):
        find_checkpoint(tmp_path, "step_000000004")
    with pytest.raises(FileNotFoundError):
        find_checkpoint(tmp_path, "step_000000099")


def test_streaming_safetensors_round_trip(tmp_path):
    from safetensors import safe_open

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).bfloat16(),
        "s": torch.tensor(2.5),
        "i": torch.arange(4),
        "h": torch.randn(2, 2).half(),
        "e": torch.empty(0, 3),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors_streaming(
        path,
        [(k, LazyTensor(v.shape, v.dtype, lambda v=v: v)) for k, v in tensors.items()],
        {"format": "dsclip"},
    )
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "dsclip"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v) and f.get_tensor(k).dtype == v.dtype, k


def _tiny_cfg():
    return create_model("tiny", vocab_size=256, eos_id=2, pad_id=0, device="meta").config


def _inputs(n=3):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 256, (n, 32), generator=g)
    tokens[:, 9], tokens[:, 10:] = 2, 0
    return torch.randn(n, 3, 32, 32, generator=g), tokens


def _embeddings(model):
    model.eval()
    images, tokens = _inputs()
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens)


@pytest.mark.parametrize(
    "layout",
    ["openclip_train_ckpt", "openclip_bare_pt", "openclip_safetensors", "dsclip_safetensors", "dsclip_dir"],
)
def test_pretrained_loads_every_layout(tmp_path, layout):
    from safetensors.torch import save_file

    open_clip = pytest.importorskip("open_clip")
    cfg = _tiny_cfg()
    torch.manual_seed(3)
    oc = open_clip.CLIP(**openclip_model_config(cfg)["model_cfg"])
    sd = oc.state_dict()
    if layout == "openclip_train_ckpt":
        path = tmp_path / "epoch_3.pt"
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, path)
    elif layout == "openclip_bare_pt":
        path = tmp_path / "oc.bin"
        torch.save(sd, path)
    elif layout == "openclip_safetensors":
        path = tmp_path / "open_clip_model.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:  # a dsclip model holding the OpenCLIP weights
        src = create_model(cfg)
        load_pretrained_into(src, _save_pt(tmp_path, sd))
        weights = save_model(src, tmp_path / "ds")
        path = weights if layout == "dsclip_safetensors" else tmp_path / "ds"
    model = create_model(cfg)
    load_pretrained_into(model, path)
    oc.eval()
    images, tokens = _inputs()
    with torch.no_grad():
        ref = oc.encode_image(images, normalize=True), oc.encode_text(tokens, normalize=True)
    got = _embeddings(model)
    tol = embedding_tol(cfg)  # same weights, OpenCLIP's modules vs dsclip's: forward rounding, unit vectors
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=tol)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=tol)
    assert torch.equal(model.logit_scale.reshape(()), oc.logit_scale.detach())


def _save_pt(tmp_path, sd):
    path = tmp_path / "src.pt"
    torch.save(sd, path)
    return path


def test_pretrained_mismatch_is_one_line_naming_first_tensor_and_changes_nothing(tmp_path):
    cfg = _tiny_cfg()
    other = create_model("tiny", vocab_size=300, eos_id=2, pad_id=0)  # another vocabulary size
    sd = other.state_dict()
    sd.pop("logit_scale")
    sd["extra.weight"] = torch.zeros(1)
    path = _save_pt(tmp_path, sd)
    model = create_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError) as e:
        load_pretrained_into(model, path)
    msg = str(e.value)
    assert "\n" not in msg
    assert "first mismatch text.token_embedding.weight: file (300, 64) vs model (256, 64)" in msg, msg
    assert "1 shape mismatch(es), 1 missing, 1 unexpected" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_openclip_tokenizer_adapter():
    pytest.importorskip("open_clip")
    from dsclip.data.openclip_tokenizer import OpenCLIPTokenizer

    tok = pickle.loads(pickle.dumps(OpenCLIPTokenizer("open_clip:ViT-B-32", context_length=16)))
    out = tok(["a photo of a cat"])
    assert out.shape == (1, 16) and out.dtype == torch.long
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (49408, 49407, 0)
    assert out[0].argmax().item() == out[0].tolist().index(tok.eos_id)  # argmax pooling finds EOT
    run_dir = Path(pytest.importorskip("tempfile").mkdtemp())
    dc.record_tokenizer(run_dir, tok)
    assert json.loads((run_dir / dc.TOKENIZER_SPEC_FILE).read_text()) == {"tokenizer": "open_clip:ViT-B-32"}


def test_convert_cli_refuses_incomplete_tag_in_one_line(tmp_path, capsys):
    from dsclip.cli import main

    engine, ck = FakeEngine(), _ckpt(tmp_path)
    ck.save(engine, 2, {"step": 2})
    (tmp_path / "checkpoints" / "step_000000002" / dc.COMPLETE).unlink()
    assert main(["convert", str(tmp_path / "checkpoints" / "step_000000002"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsclip convert: error:") and "incomplete" in err[0]
    assert not (tmp_path / "out").exists()


# --- manifests: verified resume with fallback, rotation, a full disk (issue 32) -----------------------------
def _two_tags(tmp_path, keep_last=0):
    engine, ck = FakeEngine(), _ckpt(tmp_path, keep_last)
    ck.save(engine, 2, {"step": 2})
    ck.save(engine, 4, {"step": 4})
    return engine, ck, tmp_path / "checkpoints"


def _flip(path, at=1000, n=64):
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(255 - b for b in data[at : at + n])
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:10])


DAMAGE = {  # what is done to the newest tag -> what the skip line must say
    "flipped": (lambda d: _flip(d / OPTIM), f"{OPTIM} is corrupt: crc32 "),
    "truncated": (lambda d: _truncate(d / "mp_rank_00_model_states.pt"), "is truncated: 10 bytes, expected"),
    "deleted": (lambda d: (d / OPTIM).unlink(), f"{OPTIM} is missing"),
    "no_manifest": (lambda d: (d / "MANIFEST.json").unlink(), "MANIFEST.json is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_latest_skips_a_damaged_tag_in_one_line_and_takes_the_previous(tmp_path, damage):
    _, _, ckpts = _two_tags(tmp_path)
    do, says = DAMAGE[damage]
    do(ckpts / "step_000000004")
    lines = []
    assert dc.resolve_resume("latest", tmp_path, say=lines.append) == (ckpts, "step_000000002")
    assert len(lines) == 1 and "step_000000004 skipped" in lines[0] and says in lines[0], lines
    # the same from the run folder, its checkpoints folder and the `latest` file DeepSpeed writes
    for given in (tmp_path, ckpts, ckpts / "latest"):
        assert dc.resolve_resume(str(given), tmp_path / "other", say=lines.append) == (ckpts, "step_000000002")
    # structure only (preflight, on every rank before the process group): no read, no fallback
    assert dc.resolve_resume("latest", tmp_path, verify=False) == (ckpts, "step_000000004")


def test_damaged_explicit_tag_is_one_line_naming_file_and_fix(tmp_path):
    _, _, ckpts = _two_tags(tmp_path)
    _flip(ckpts / "step_000000004" / OPTIM)
    with pytest.raises(ConfigError) as e:
        dc.resolve_resume(str(ckpts / "step_000000004"), tmp_path, say=pytest.fail)
    msg = str(e.value)
    assert "\n" not in msg and f"{OPTIM} is corrupt" in msg and "step_000000002" in msg and "--resume latest" in msg
    assert dc.resolve_resume(str(ckpts / "step_000000002"), tmp_path) == (ckpts, "step_000000002")


def test_tag_of_an_older_dsclip_is_used_with_one_unverified_line(tmp_path):
    _, _, ckpts = _two_tags(tmp_path)
    tag = ckpts / "step_000000004"
    (tag / dc.MANIFEST).unlink()
    (tag / dc.COMPLETE).write_text(json.dumps({"step": 4}))  # what dsclip wrote before manifests
    lines = []
    assert dc.resolve_resume("latest", tmp_path, say=lines.append) == (ckpts, "step_000000004")
    assert lines == [
        f"dsclip: checkpoint {tag} is unverified (no manifest: written by an older dsclip); using it as it is"
    ]


def test_no_tag_verifies_is_an_error_not_a_fresh_start(tmp_path):
    _, _, ckpts = _two_tags(tmp_path)
    for tag in ("step_000000002", "step_000000004"):
        _flip(ckpts / tag / OPTIM)
    lines = []
    with pytest.raises(ConfigError, match="none of the 2 checkpoints"):
        dc.resolve_resume("latest", tmp_path, say=lines.append)
    assert len(lines) == 2
    assert dc.resolve_resume("latest", tmp_path / "fresh") is None  # no checkpoint at all: a fresh start


def test_prune_keeps_the_newest_tag_that_verifies(tmp_path):
    engine, ck, ckpts = _two_tags(tmp_path, keep_last=2)
    _truncate(ckpts / "step_000000004" / OPTIM)  # damaged after its save: no fallback, takes no place
    ck.save(engine, 6, {"step": 6})
    assert dc.complete_tags(ckpts) == ["step_000000002", "step_000000006"]


def test_prepare_resume_removes_leftover_partial_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(dc.universal, "needs_universal", lambda state, world_size: False)  # fake shards
    _, ck, ckpts = _two_tags(tmp_path)
    (ckpts / ".partial.step_000000006").mkdir()
    (ckpts / ".partial.step_000000006" / OPTIM).write_bytes(b"x" * 100)  # a save killed mid-write
    assert ck.prepare_resume("latest", world_size=1) == {}
    assert ck.resume_point == dc.ResumePoint(ckpts, "step_000000004")
    assert not (ckpts / ".partial.step_000000006").exists()


class DiskFullEngine(FakeEngine):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / OPTIM).write_bytes(b"half")
        raise self.exc


def test_disk_full_during_save_is_one_line_partial_removed_latest_kept(tmp_path):
    _, ck, ckpts = _two_tags(tmp_path)
    with pytest.raises(dc.DiskFullError) as e:
        ck.save(DiskFullEngine(OSError(28, "No space left on device")), 6, {"step": 6})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"disk full while saving checkpoint to {ckpts / '.partial.step_000000006'}")
    assert "latest still names step_000000004" in msg and "--keep-last" in msg and "--logs" in msg
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000002", "step_000000004"]
    assert (ckpts / "latest").read_text() == "step_000000004"
    assert dc.resolve_resume("latest", tmp_path, say=pytest.fail) == (ckpts, "step_000000004")


def test_torch_full_disk_error_without_errno_is_recognised(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from dsclip.checkpoint import diskfull

    # what torch.save raises on a full file system (seen on a 2 MiB tmpfs): no errno, no "disk full"
    exc = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not diskfull.is_disk_full(exc, tmp_path)  # space left: a write error of another kind
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2 << 20, 2 << 20, 0))
    assert diskfull.is_disk_full(exc, tmp_path)
    assert not diskfull.is_disk_full(KeyError("x"), tmp_path)
    _, ck, ckpts = _two_tags(tmp_path)
    with pytest.raises(dc.DiskFullError):
        ck.save(DiskFullEngine(exc), 6, {"step": 6})
    assert not (ckpts / ".partial.step_000000006").exists()


def _convert(tmp_path, capsys, *args):
    from dsclip.cli import main

    rc = main(["convert", str(tmp_path), *args])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_convert_refuses_damaged_input_and_existing_output_in_one_line(tmp_path, capsys):
    _, _, ckpts = _two_tags(tmp_path)
    out = tmp_path / "out"
    _flip(ckpts / "step_000000004" / OPTIM)
    rc, err = _convert(tmp_path, capsys, "-o", str(out))
    assert rc == 2 and len(err) == 1 and f"{OPTIM} is corrupt" in err[0] and "--tag (step_000000002)" in err[0], err
    assert not out.exists()

    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for o in (out, out / "notes.txt", tmp_path / "x.safetensors"):
        (tmp_path / "x.safetensors").write_bytes(b"earlier export")
        rc, err = _convert(tmp_path, capsys, "--tag", "step_000000002", "-o", str(o))
        assert rc == 2 and len(err) == 1 and f"output {o} already exists" in err[0] and "--force" in err[0], err
    assert (out / "notes.txt").read_text() == "mine" and (tmp_path / "x.safetensors").read_bytes() == b"earlier export"

    # a tag of an older dsclip (no manifest) whose shard is damaged: a note and one error line, no traceback
    tag = ckpts / "step_000000002"
    (tag / dc.MANIFEST).unlink()
    (tag / dc.COMPLETE).write_text(json.dumps({"step": 2}))
    rc, err = _convert(tmp_path, capsys, "--tag", "step_000000002", "-o", str(tmp_path / "new"))
    errors = [line for line in err if line.startswith("dsclip convert: error:")]
    assert rc == 2 and len(errors) == 1 and "cannot be read" in errors[0], err
    assert any("unverified (no manifest: written by an older dsclip)" in line for line in err)
    assert not any("Traceback" in line for line in err)


def test_manifest_takes_the_writing_ranks_checksums_while_the_size_matches(tmp_path):
    from dsclip.checkpoint import manifest

    (tmp_path / "a.pt").write_bytes(b"a" * 10)
    (tmp_path / "b.pt").write_bytes(b"b" * 10)
    given = {"size": 10, "crc32": "0000abcd"}  # what rank 1 computed for its shard, not read again on rank 0
    stale = {"size": 9, "crc32": "0000abcd"}  # the file changed since: checksummed here
    files = json.loads(manifest.build(tmp_path, {"a.pt": given, "b.pt": stale}))["files"]
    assert files["a.pt"] == given and files["b.pt"] == manifest.entry(tmp_path / "b.pt") != stale
    assert manifest.entries(tmp_path, [str(tmp_path / "b.pt"), "/elsewhere/c.pt"]) == {"b.pt": files["b.pt"]}


def test_universal_copy_is_reused_only_while_it_verifies(tmp_path, monkeypatch, capsys):
    from deepspeed.checkpoint import ds_to_universal

    from dsclip.checkpoint import universal

    calls = []

    def fake_main(args):  # what ds_to_universal writes, without DeepSpeed shards to read
        calls.append(args.output_folder)
        (Path(args.output_folder) / "zero" / "w").mkdir(parents=True)
        (Path(args.output_folder) / "zero" / "w" / "fp32.pt").write_bytes(bytes(range(256)) * 8)

    monkeypatch.setattr(ds_to_universal, "main", fake_main)
    _, _, ckpts = _two_tags(tmp_path)
    out = universal.convert_to_universal(ckpts, "step_000000004")
    assert universal.convert_to_universal(ckpts, "step_000000004") == out and len(calls) == 1  # reused
    _flip(out / "zero" / "w" / "fp32.pt")
    capsys.readouterr()
    assert universal.convert_to_universal(ckpts, "step_000000004") == out and len(calls) == 2  # made again
    assert "zero/w/fp32.pt is corrupt" in capsys.readouterr().out
    assert dc.manifest.verify(out).ok and dc.manifest.verify(ckpts / "step_000000004").ok


def test_keep_last_keeps_the_last_confirmed_tag_until_a_step_confirms_the_new_one(tmp_path):
    """A tag is confirmed once a later step trains on its weights with a finite loss (certify): --keep-last 1
    keeps the previous tag until then, so weights that blow up right after a save never cost the good one."""
    engine, ck = FakeEngine(), _ckpt(tmp_path, keep_last=1)
    ckpts = tmp_path / "checkpoints"
    ck.certify(1)  # step 2 was good
    ck.save(engine, 2, {"step": 2})
    ck.certify(3)  # steps 3, 4 good: step 2's weights trained on finitely
    ck.save(engine, 4, {"step": 4})
    assert dc.complete_tags(ckpts) == ["step_000000002", "step_000000004"]  # 4 is not confirmed yet
    ck.certify(4)  # step 5 good
    assert dc.complete_tags(ckpts) == ["step_000000004"]


def test_divergence_marks_unconfirmed_tags_and_points_latest_at_the_confirmed_one(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path, keep_last=1)
    ckpts = tmp_path / "checkpoints"
    ck.certify(3)
    ck.save(engine, 4, {"step": 4})
    ck.certify(5)
    ck.save(engine, 6, {"step": 6})  # step 6's loss was finite, its update blew the weights up
    assert (ckpts / "latest").read_text() == "step_000000006"
    assert ck.mark_diverged(9, first_bad=7) == ckpts / "step_000000004"  # steps 7-9 were NaN
    assert (ckpts / "latest").read_text() == "step_000000004"
    assert json.loads((ckpts / "step_000000006" / dc.DIVERGED).read_text())["first_bad_step"] == 7
    assert not (ckpts / "step_000000004" / dc.DIVERGED).exists()
    # a resume never takes a diverged tag: not by latest (pointer lost), not by name
    (ckpts / "latest").unlink()
    lines = []
    assert dc.resolve_resume("latest", tmp_path, say=lines.append) == (ckpts, "step_000000004")
    assert len(lines) == 1 and "step_000000006 skipped: marked DIVERGED" in lines[0] and "step 7" in lines[0]
    with pytest.raises(ConfigError, match="step_000000006 is not to be used: marked DIVERGED.*step_000000004"):
        dc.resolve_resume(str(ckpts / "step_000000006"), tmp_path)


def test_divergence_with_no_confirmed_tag_removes_latest(tmp_path):
    engine, ck = FakeEngine(), _ckpt(tmp_path, keep_last=1)
    ck.save(engine, 1, {"step": 1})  # --lr 1e6: step 1 finite, step 2 on NaN
    assert ck.mark_diverged(3, first_bad=2) is None
    assert not (tmp_path / "checkpoints" / "latest").exists()
    with pytest.raises(ConfigError, match="none of the 1 checkpoints"):
        dc.resolve_resume("latest", tmp_path, say=lambda m: None)


def test_save_most_recent_keeps_the_confirmed_extra_until_the_new_one_is_confirmed(tmp_path):
    engine = FakeEngine()
    ck = dc.Checkpointer(tmp_path, every_n_steps=0, every_n_epochs=0, keep_last=0, rank=0, most_recent=True)
    ckpts = tmp_path / "checkpoints"
    ck.certify(4)
    assert ck.maybe_save(engine, 5, {"step": 5}, epoch_end=True, epoch=0)
    ck.certify(9)
    assert ck.maybe_save(engine, 10, {"step": 10}, epoch_end=True, epoch=1)
    assert dc.complete_tags(ckpts) == ["step_000000005", "step_000000010"]  # 10 is not confirmed yet
    ck.certify(10)
    assert dc.complete_tags(ckpts) == ["step_000000010"]
