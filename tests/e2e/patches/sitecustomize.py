"""Test fixtures that patch dsclip from outside, in CLI subprocesses (this folder goes on PYTHONPATH).

``DSCLIP_FIXTURE_SLOW_SAVE=SECONDS@STEP``: rank 0 sleeps SECONDS when saving step STEP, after every
rank's shards are written and before the tag is completed: the window in which
tests/e2e/test_checkpoint_crash.py kills the job.

``DSCLIP_FIXTURE_SLOW_WRITE=SECONDS@STEP``: the background writer of an asynchronous save (--async-save)
sleeps SECONDS before each file of step STEP's checkpoint: the window in which tests/e2e/test_async_save.py
kills the job while the files are being written (deterministic: the write cannot finish before the kill).

``DSCLIP_FIXTURE_DISK_FULL=STEP[@RANK]``: the save of step STEP meets a full disk (on rank RANK only, when
given): the first shard torch.save writes for it is left half-written and the write fails with ENOSPC
(tests/e2e/test_checkpoint_verify.py).

``DSCLIP_FIXTURE_DS_RECEIVED=PATH``: the config dict handed to ``deepspeed.initialize`` is written to
PATH (as JSON, at the call), so a test can compare it with the run folder's ds_config.json.

``DSCLIP_FIXTURE_DIE_IN_SAVE=RANK@STEP``: rank RANK is SIGKILLed while writing its shards of step STEP's
checkpoint (tests/e2e/test_rank_lost.py: what the surviving ranks say).
"""

import json
import os
import time

_slow_save = os.environ.get("DSCLIP_FIXTURE_SLOW_SAVE")
if _slow_save:
    from dsclip.checkpoint import ds_checkpoint

    _seconds, _, _step = _slow_save.partition("@")
    _complete = ds_checkpoint.Checkpointer._complete

    def _slow_complete(self, part_dir, step, *args, **kwargs):
        if step == int(_step):
            time.sleep(float(_seconds))
        return _complete(self, part_dir, step, *args, **kwargs)

    ds_checkpoint.Checkpointer._complete = _slow_complete

_slow_write = os.environ.get("DSCLIP_FIXTURE_SLOW_WRITE")
if _slow_write:
    from dsclip.checkpoint import async_save

    _write_seconds, _, _write_step = _slow_write.partition("@")
    _write, _slow_tag = async_save.DsclipCheckpointEngine.write, f".partial.step_{int(_write_step):09d}"

    def _slow_file_write(self, state_dict, path):
        if _slow_tag in str(path):
            time.sleep(float(_write_seconds))
        return _write(self, state_dict, path)

    async_save.DsclipCheckpointEngine.write = _slow_file_write

_disk_full = os.environ.get("DSCLIP_FIXTURE_DISK_FULL")
if _disk_full:
    import errno

    import torch

    _step, _, _rank = _disk_full.partition("@")
    _save, _full_tag = torch.save, f".partial.step_{int(_step):09d}"

    def _full_save(obj, f, *args, **kwargs):
        if _full_tag in str(f) and _rank in ("", os.environ.get("RANK", "0")):
            with open(f, "wb") as out:
                out.write(b"\0" * 4096)  # what fitted before the disk was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return _save(obj, f, *args, **kwargs)

    torch.save = _full_save

_received = os.environ.get("DSCLIP_FIXTURE_DS_RECEIVED")
if _received:
    import deepspeed

    _initialize = deepspeed.initialize

    def _recording_initialize(*args, **kwargs):
        with open(_received, "w") as f:
            json.dump(kwargs.get("config"), f, default=str)
        return _initialize(*args, **kwargs)

    deepspeed.initialize = _recording_initialize

_die = os.environ.get("DSCLIP_FIXTURE_DIE_IN_SAVE")
if _die:  # ``RANK@STEP``: that rank is SIGKILLed while writing its shards of step STEP's checkpoint
    import signal

    import torch

    _rank, _, _step = _die.partition("@")
    _save_for_die, _die_tag = torch.save, f".partial.step_{int(_step):09d}"

    def _dying_save(obj, f, *args, **kwargs):
        if _die_tag in str(f) and os.environ.get("RANK", "0") == _rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return _save_for_die(obj, f, *args, **kwargs)

    torch.save = _dying_save
