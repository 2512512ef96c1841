"""Asynchronous saves (dsclip.checkpoint.async_save through Checkpointer) and data-only loads
(dsclip.checkpoint.safe_load), on one process with a stand-in engine that writes through the checkpoint
engine as DeepSpeed's save_checkpoint does."""

from __future__ import annotations

import collections
import errno
import threading
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from dsclip.checkpoint import ds_checkpoint as dc
from dsclip.checkpoint import manifest, safe_load
from dsclip.checkpoint.async_save import DsclipCheckpointEngine, host_copy
from dsclip.model import create_model

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class WritingEngine:
    """Like DeepSpeed's save_checkpoint: every file through ``checkpoint_engine.save``, the live tensors handed
    over (the optimizer state keeps changing after the call returns)."""

    def __init__(self):
        self.module = create_model("tiny", device="meta")
        self.checkpoint_engine = TorchCheckpointEngine()
        DsclipCheckpointEngine.install(self)
        self.weights = torch.arange(1000, dtype=torch.float32)
        self.moments = {"exp_avg": torch.ones(1000), "step": 3}

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(d, exist_ok=True)
        self.checkpoint_engine.save(
            {"module": {"w": self.weights}, **client_state}, str(d / "mp_rank_00_model_states.pt")
        )
        self.checkpoint_engine.save({"optimizer_state_dict": self.moments}, str(d / OPTIM))

    def train_step(self):  # what a step does to the state the save handed over: in place
        self.weights.add_(1.0)
        self.moments["exp_avg"].mul_(2.0)


class Gate:
    """Holds the background writer before each file until released."""

    def __init__(self, ce: DsclipCheckpointEngine, fail: BaseException | None = None):
        self.release, self.entered, self.fail, self._write = threading.Event(), threading.Event(), fail, ce.write
        ce.write = self

    def __call__(self, obj, path):
        self.entered.set()
        self.release.wait(30)
        if self.fail is not None:
            Path(path).write_bytes(b"\0" * 64)  # what fitted
            raise self.fail
        self._write(obj, path)


def _ckpt(tmp_path, keep_last=0):
    return dc.Checkpointer(tmp_path, every_n_steps=2, every_n_epochs=0, rank=0, async_save=True, keep_last=keep_last)


BUSY, IDLE = (0.0, 0.0, 1.0), (0.0, 0.0, 0.0)  # the step's summed flags: SIGUSR1, SIGTERM, writes running


def test_async_save_returns_after_the_copy_and_completes_once_no_rank_is_writing(tmp_path):
    engine, ck = WritingEngine(), _ckpt(tmp_path, keep_last=0)
    completed = []
    ck.on_complete.append(completed.append)
    gate = Gate(engine.checkpoint_engine)
    ck.save(engine, 2, {"step": 2})
    engine.train_step()  # training goes on while the files are written: they must hold the step-2 state
    assert gate.entered.wait(30) and ck.write_busy() == 1.0
    assert (
        not (tmp_path / "checkpoints" / "latest").exists()
        and not (tmp_path / "checkpoints" / "step_000000002").exists()
    )
    assert not ck.after_step(BUSY)  # some rank still writing: nothing happens
    gate.release.set()
    ck.in_flight.write.wait()
    assert ck.write_busy() == 0.0 and ck.after_step(IDLE)
    tag = tmp_path / "checkpoints" / "step_000000002"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000002" and completed == [tag]
    assert manifest.verify(tag).ok
    saved = safe_load.load_data(tag / "mp_rank_00_model_states.pt")
    assert torch.equal(saved["module"]["w"], torch.arange(1000, dtype=torch.float32))  # not the +1 of the step
    assert torch.equal(safe_load.load_data(tag / OPTIM)["optimizer_state_dict"]["exp_avg"], torch.ones(1000))
    times = ck.save_times[0]
    assert times.asynchronous and times.complete and times.bytes == 2 * 1000 * 4
    assert times.stall_s >= 0 and times.write_s > 0 and ck.save_totals()["saves"] == 1.0


def test_a_save_while_one_is_writing_waits_for_it_and_counts_the_wait(tmp_path):
    engine, ck = WritingEngine(), _ckpt(tmp_path, keep_last=1)
    gate = Gate(engine.checkpoint_engine)
    ck.save(engine, 2, {"step": 2})
    assert gate.entered.wait(30)
    threading.Timer(0.3, gate.release.set).start()
    ck.save(engine, 4, {"step": 4})  # at most one write in flight: completes step 2 first
    assert ck.save_times[0].complete and ck.save_times[0].wait_s >= 0.2
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000002"
    ck.drain("the end of the run")  # one line, then step 4 complete and --keep-last 1 applied
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000004"
    assert dc.complete_tags(tmp_path / "checkpoints") == ["step_000000004"]


@pytest.mark.parametrize("kind", ["full", "other"])
def test_a_failed_background_write_is_one_line_and_latest_stays(tmp_path, kind):
    engine, ck = WritingEngine(), _ckpt(tmp_path)
    ck.save(engine, 2, {"step": 2})
    ck.drain("test")
    fail = OSError(errno.ENOSPC, "No space left on device") if kind == "full" else PermissionError("read-only")
    gate = Gate(engine.checkpoint_engine, fail=fail)
    gate.release.set()
    ck.save(engine, 4, {"step": 4})
    ck.in_flight.write.wait()
    error = dc.DiskFullError if kind == "full" else dc.CheckpointWriteError
    with pytest.raises(error) as e:
        ck.after_step(IDLE)
    assert "\n" not in str(e.value) and "latest still names step_000000002" in str(e.value)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000002"
    assert not (tmp_path / "checkpoints" / ".partial.step_000000004").exists()


def test_host_copy_shares_no_memory_and_keeps_the_containers():
    frag = collections.namedtuple("frag", "start numel")
    t = torch.arange(10.0)
    state = collections.OrderedDict(a=t, b=[t[2:4], (frag(1, 2), "x")], c={"same": t})
    copied = host_copy(state)
    t.mul_(0)
    assert type(copied) is collections.OrderedDict and type(copied["b"][1][0]) is frag
    assert torch.equal(copied["a"], torch.arange(10.0)) and copied["c"]["same"] is copied["a"]  # shared once
    assert copied["b"][0].untyped_storage().nbytes() == 2 * 4  # a view is copied compactly


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # loading this creates the file


def test_a_pickle_that_would_run_code_is_refused_in_one_line_and_nothing_runs(tmp_path):
    path, marker = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "ran"
    torch.save({"module": _RunsCode(marker)}, path)
    with pytest.raises(safe_load.UnsafeCheckpointError) as e:
        safe_load.load_data(path, map_location="cpu")
    assert not marker.exists()
    assert (
        "\n" not in str(e.value) and str(path) in str(e.value) and "io.open" in str(e.value)
    )  # builtins.open is io.open
    with safe_load.data_only(), pytest.raises(safe_load.UnsafeCheckpointError):  # DeepSpeed's own torch.load
        torch.load(path, weights_only=False)
    assert not marker.exists() and torch.load is safe_load._real_load  # restored


def test_the_deepspeed_classes_its_checkpoints_hold_load():
    import io

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    buf = io.BytesIO()
    obj = {"ls": LossScaler(1.0), "dls": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False), "z": ZeroStageEnum.gradients}
    obj["f"] = fragment_address(numel=3, start=1)
    torch.save(obj, buf, _use_new_zipfile_serialization=False)  # DeepSpeed's default format
    buf.seek(0)
    got = safe_load.load_data(buf)
    assert got["z"] is ZeroStageEnum.gradients and got["f"] == fragment_address(numel=3, start=1)
    assert isinstance(got["ls"], LossScaler) and got["ls"].cur_scale == 1.0


def test_each_rank_checksums_only_the_files_it_loads(tmp_path):
    """Resume verification (issue 65): rank R reads its own shards, rank 0 the module file and the small shared
    files; every file's size is still checked by each, and each file is read by exactly one rank."""
    names = [
        "mp_rank_00_model_states.pt",  # ZeRO-1/2's module file: data-parallel rank 0 wrote it
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",  # ZeRO-3's per-rank module file
        "ema_rank00001.pt",
        "dsclip_state.json",
    ]
    assert [manifest.loading_rank(n, 2) for n in names] == [0, 0, 1, 1, 1, 0]
    assert manifest.loading_rank("zero_pp_rank_3_mp_rank_00_optim_states.pt", 2) == 1  # saved on 4, read on 2
    tag = tmp_path / "step_000000002"
    tag.mkdir()
    for n in names:
        (tag / n).write_bytes(n.encode() * 100)
    (tag / "MANIFEST.json").write_text(manifest.build(tag))
    shard = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # same size, other bytes: only a checksum finds it
    shard.write_bytes(bytes(data))
    read = []

    def owned_by(rank):
        def owned(rel):
            mine = manifest.loading_rank(rel, 2) == rank
            read.extend([rel] if mine else [])
            return mine

        return owned

    assert manifest.verify(tag, owned=owned_by(0)).ok  # rank 0 does not read rank 1's shard
    assert "corrupt" in manifest.verify(tag, owned=owned_by(1)).problem
    assert sorted(read) == sorted(names)  # every file read once, by one of the two ranks


def test_the_host_buffers_of_one_save_are_the_next_saves(tmp_path):
    """Allocating the copy's memory at every save costs more than the copy (page faults; pinning on GPU): a
    written file's buffers go back to the pool and the next save copies into them."""
    engine, ck = WritingEngine(), _ckpt(tmp_path)
    pool = engine.checkpoint_engine.buffers
    ck.save(engine, 2, {"step": 2})
    ck.drain("test")
    kept = {t.data_ptr() for ts in pool._free.values() for t in ts}
    assert len(kept) == 2  # the weights' and the moment's copies, written and given back
    engine.train_step()
    ck.save(engine, 4, {"step": 4})
    ck.drain("test")
    # new buffers would be in the pool beside the old ones: the second save copied into the first's
    assert sorted(t.data_ptr() for ts in pool._free.values() for t in ts) == sorted(kept)
    saved = safe_load.load_data(tmp_path / "checkpoints" / "step_000000004" / "mp_rank_00_model_states.pt")
    assert torch.equal(saved["module"]["w"], engine.weights)  # the reused buffer holds this save's values


def test_the_runs_close_joins_a_write_in_flight_and_leaves_latest(tmp_path):
    """A way out that did not drain (an error, a lost rank): Checkpointer.close, the run's last closer, waits for
    this rank's writer thread without completing the tag (a collective): no thread outlives the run, the tag stays
    partial (removed at the next start) and latest stays on the last complete checkpoint."""
    engine, ck = WritingEngine(), _ckpt(tmp_path)
    ck.save(engine, 2, {"step": 2})
    ck.drain("a first checkpoint")
    gate = Gate(engine.checkpoint_engine)
    ck.save(engine, 4, {"step": 4})
    assert gate.entered.wait(30)
    threading.Timer(0.3, gate.release.set).start()
    ck.close()
    assert ck.in_flight is None and not [t for t in threading.enumerate() if t.name.startswith("dsclip-save-")]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000000002" and not (ckpts / "step_000000004").exists()
    ck.close()  # idempotent
