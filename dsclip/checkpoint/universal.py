"""Resume on a different number of ranks: DeepSpeed universal checkpoints, made on demand.

A ZeRO checkpoint stores each rank's slice of the flat fp32 master weights and Adam moments, so
it only loads on the world size that wrote it. ``deepspeed.checkpoint.ds_to_universal`` rewrites a
tag as one file per parameter and optimizer state (``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``),
which an engine configured with ``"checkpoint": {"load_universal": true}`` re-slices for its own
world size. Checked with DeepSpeed 0.19.8 on CPU/gloo for ZeRO-2 and ZeRO-3, world 2 -> 1 and 1 -> 2
(tests/e2e/test_checkpoint_resume.py).

The universal copy lives inside the tag (``<tag>/universal/``), is written by rank 0 into a
temporary folder and renamed into place with a COMPLETE marker and its own manifest, so a kill
during the conversion leaves nothing that looks usable, and a second resume reuses it if it still
verifies (and converts again if not).

Data position and schedule (see ``resume_position``): the loop's data order depends only on the
global batch (rank r's micro-batch m of an epoch is ``perm[(m * world + r) * B : ...]``, so one
optimizer step always covers the next ``world * B * accum`` samples of the epoch's permutation).
- Same global batch (e.g. 2 ranks x 8 -> 1 rank x 16): resume at the same optimizer step; the LR
  schedule state is restored as saved and every later step sees the same samples as the
  uninterrupted run.
- Different global batch: resume at ``samples_done_in_epoch // new_global_batch`` within the saved
  epoch (a few samples may be seen twice, none skipped), and the LR schedule is re-positioned to
  that step of the new run's schedule (its total length follows the new batch size).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from argparse import Namespace
from pathlib import Path
from typing import Any

from dsclip.checkpoint import manifest
from dsclip.checkpoint.layout import COMPLETE, MANIFEST, STATE_FILE
from dsclip.dist import from_rank0

UNIVERSAL = "universal"


def saved_state(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """The dsclip state of a complete tag (step, epoch, world size, batch triad, ...)."""
    return json.loads((Path(ckpt_dir) / tag / STATE_FILE).read_text())


def needs_universal(state: dict[str, Any], world_size: int) -> bool:
    """True when the checkpoint's flat ZeRO partitions cannot be loaded as they are: saved on another
    number of ranks, or with another parameter order inside the optimizer groups (checkpoints from
    before dsclip.engine.optim.PARAM_ORDER 2 have no "param_order": order 1)."""
    saved = state.get("world_size")
    if saved is not None and int(saved) != int(world_size):
        return True
    # lazy: dsclip.engine.optim loads torch, and the run config's parser reaches this module (CheckpointArgs)
    from dsclip.engine.optim import PARAM_ORDER

    return int(state.get("param_order", 1)) != PARAM_ORDER


def convert_to_universal(ckpt_dir: Path, tag: str) -> Path:
    """Write ``<ckpt_dir>/<tag>/universal`` (idempotent; single process). Returns that folder."""
    # lazy: the run config imports this package (CheckpointArgs); deepspeed loads only for a conversion
    from deepspeed.checkpoint import ds_to_universal

    tag_dir = Path(ckpt_dir) / tag
    out = tag_dir / UNIVERSAL
    if (out / COMPLETE).exists():
        verdict = manifest.verify(out)  # made by an earlier resume; the disk may have damaged it since
        if verdict.ok:
            return out
        print(f"dsclip: universal copy {out} fails verification ({verdict.problem}): converting again", flush=True)
    tmp = tag_dir / f".{UNIVERSAL}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    args = Namespace(
        input_folder=str(tag_dir),
        output_folder=str(tmp),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )  # plain (non-Megatron) models carry no universal_checkpoint_info
    from dsclip.checkpoint.safe_load import data_only

    with data_only():  # ds_to_universal torch.loads every shard itself: data only (dsclip.checkpoint.safe_load)
        ds_to_universal.main(args)
    (tag_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer; we pass tags explicitly
    shutil.copyfile(tag_dir / STATE_FILE, tmp / STATE_FILE)
    (tmp / COMPLETE).write_text(json.dumps({"from": tag, "manifest": MANIFEST}))
    (tmp / MANIFEST).write_text(manifest.build(tmp))  # last: checked when a later resume reuses the copy
    shutil.rmtree(out, ignore_errors=True)  # an older incomplete attempt
    os.replace(tmp, out)
    return out


def prepare_universal(ckpt_dir: Path, tag: str, *, rank: int) -> tuple[Path, str]:
    """Collective: rank 0 converts (if not done before), everyone waits. Returns the (load_dir, tag)
    to pass to ``engine.load_checkpoint`` with ``load_universal`` on."""
    error = None
    if rank == 0:
        try:
            convert_to_universal(ckpt_dir, tag)
        except ValueError as e:  # a file refused as code (safe_load) or another user-fixable problem
            error = e
    error = from_rank0(error)  # collective: every rank raises rank 0's one line, none waits for it
    if error is not None:
        raise error
    return Path(ckpt_dir) / tag, UNIVERSAL


def resume_position(state: dict[str, Any], *, global_batch: int, steps_per_epoch: int) -> tuple[int, bool]:
    """(optimizer step to continue from, whether it differs from the saved step).

    Same global batch: the saved step. Otherwise the saved epoch plus the samples already done in it,
    in whole steps of the new global batch."""
    step = int(state["step"])
    old_global = int(state.get("batch_size", 0)) * int(state.get("accum_freq", 1)) * int(state.get("world_size", 0))
    if old_global in (0, global_batch):
        return step, False
    epoch, in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
    new_step = epoch * steps_per_epoch + min(in_epoch * old_global // global_batch, steps_per_epoch)
    return new_step, new_step != step


def set_schedule_step(engine, step: int) -> None:
    """Re-position the LR scheduler so the next optimizer step uses the LR of step ``step``.

    Through the scheduler's public ``step()``: from ``last_epoch = step - 1`` it computes every group's LR at
    ``step`` (LambdaLR: base LR x multiplier) and records it as the last LR, as a scheduler stepped there would."""
    sched = engine.lr_scheduler
    if sched is None or not hasattr(sched, "lr_lambdas"):
        return
    sched.last_epoch = step - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a re-positioning, not a step
        warnings.simplefilter("ignore", UserWarning)
        sched.step()


def load_universal(engine, load_dir: Path, tag: str) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` of a universal tag (ZeRO-3's optimizer state repaired: the seam's
    dsclip/engine/patches/universal_zero3.py)."""
    from dsclip.engine.patches import universal_zero3

    report = getattr(engine, "dsclip_patches", None)  # --engine-patches (dsclip.engine.build)
    enabled = report is None or universal_zero3.NAME in report.selected
    return universal_zero3.load_universal(engine, load_dir, tag, enabled=enabled)
