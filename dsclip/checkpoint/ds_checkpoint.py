"""Step-granular DeepSpeed checkpoints that a crash or kill can never corrupt.

Layout of ``<run>/checkpoints/``::

    step_000000120/                    one DeepSpeed tag (all ranks' shards + dsclip_state.json
                                       + model_config.json)
    step_000000120/COMPLETE            written by rank 0 only after every rank finished writing
    step_000000120/universal/          a world-size-independent copy, made on demand when a run
                                       resumes on a different number of ranks (dsclip.checkpoint.universal)
    latest                             the newest COMPLETE tag; replaced atomically (DeepSpeed tools read it)
    .partial.step_000000120/           a save in progress (never read; removed by the next save)

A save writes every rank's shards into ``.partial.<tag>``, then rank 0 adds the dsclip state, the
model config and ``COMPLETE`` and renames the folder to ``<tag>`` (one atomic rename), and only
then points ``latest`` at it. So a folder named ``step_*`` is always complete, whenever the job is
killed, and re-saving a tag that ``latest`` names (a preempted run saving again at the step it
resumed from) never leaves ``latest`` pointing at half-written shards.

DeepSpeed's own ``latest`` file is written at the end of ``save_checkpoint`` without a
completeness check across ranks and without an atomic rename, so we switch it off
(``save_latest=False``) and write it ourselves once the tag is complete. ``--resume latest``
only ever sees complete checkpoints; pruning (``--keep-last``) happens after the new one is
complete, and only removes complete tags older than it (each is first renamed out of the way, so
a kill during the deletion never leaves a half-deleted folder that still looks complete).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsclip.checkpoint import universal
from dsclip.checkpoint.layout import (
    COMPLETE,
    LATEST,
    MODEL_CONFIG_FILE,
    PARTIAL_PREFIX,
    STATE_FILE,
    TOKENIZER_FILE,
    TOKENIZER_SPEC_FILE,
    TRASH_PREFIX,
)
from dsclip.config_base import ConfigError, opt
from dsclip.dist import barrier

_TAG_RE = re.compile(r"step_\d+")


def tag_for_step(step: int) -> str:
    return f"step_{step:09d}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete ``step_*`` tags, oldest first (in-progress ``.partial.*`` folders are never listed)."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if _TAG_RE.fullmatch(p.name) and (p / COMPLETE).exists()]
    return sorted(tags)


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def record_tokenizer(run_dir: Path, tokenizer) -> None:
    """Keep the run's tokenizer with the run (rank 0): ``dsclip convert`` copies it next to the weights.

    A SentencePiece model file is copied to ``<run>/tokenizer.model`` (the cache it came from may be
    gone by the time someone converts the run); a tokenizer without a file but with a ``spec`` such as
    ``open_clip:ViT-B-32`` is recorded in ``<run>/tokenizer.json``."""
    path = getattr(tokenizer, "model_path", None)
    spec = getattr(tokenizer, "spec", None)
    run_dir.mkdir(parents=True, exist_ok=True)
    if path and Path(path).is_file():
        dst = run_dir / TOKENIZER_FILE
        if Path(path).resolve() != dst.resolve():
            tmp = dst.with_name(f".{dst.name}.tmp.{os.getpid()}")
            shutil.copyfile(path, tmp)
            os.replace(tmp, dst)
    elif spec:
        _atomic_write(run_dir / TOKENIZER_SPEC_FILE, json.dumps({"tokenizer": spec}))


def latest_complete(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag (or None)."""
    pointer = ckpt_dir / LATEST
    if pointer.exists():
        tag = pointer.read_text().strip()
        if (ckpt_dir / tag / COMPLETE).exists():
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def resolve_resume(resume: str, run_dir: Path) -> tuple[Path, str] | None:
    """``--resume`` -> (checkpoint dir, tag), or None when 'latest' finds nothing (fresh start).

    Accepts 'latest', a checkpoints dir, a run dir, or a tag dir (``.../step_000000120``).
    """
    if resume == "latest":
        ckpt_dir = run_dir / "checkpoints"
        tag = latest_complete(ckpt_dir)
        return None if tag is None else (ckpt_dir, tag)
    p = Path(resume)
    if (p / COMPLETE).exists():
        return p.parent, p.name
    for ckpt_dir in (p, p / "checkpoints"):
        tag = latest_complete(ckpt_dir)
        if tag is not None:
            return ckpt_dir, tag
    if p.is_dir() and any(p.glob("*/*model_states.pt")) or (p / LATEST).exists():
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint there (an interrupted save?)")
    raise FileNotFoundError(f"--resume {resume}: not a checkpoint, checkpoints folder or run folder")


@dataclass
class CheckpointArgs:
    """Run config section ``checkpoint``: when to save, what to keep, where to resume from."""

    save_frequency: int = opt(1, "Save a checkpoint every N epochs (0: never at epoch ends).")
    save_every_n_steps: int = opt(0, "Also save every N optimizer steps (0: off).")
    resume: str | None = opt(None, "'latest' (the newest complete checkpoint of this run) or a checkpoint path.")
    keep_last: int = opt(0, "Keep only the newest N checkpoints (0: keep all). Pruning happens after a save completes.")
    delete_previous_checkpoint: bool = opt(False, "OpenCLIP's flag: same as --keep-last 1.")
    save_most_recent: bool = opt(
        False,
        "Also save at every epoch end, removing the previous checkpoint saved only for this (OpenCLIP's "
        "epoch_latest.pt); --resume latest loads the newest.",
    )

    def __post_init__(self):
        if self.delete_previous_checkpoint and self.keep_last == 0:  # OpenCLIP's spelling of --keep-last 1
            self.keep_last = 1

    def check(self) -> None:
        if self.keep_last < 0:
            raise ConfigError("'keep_last' must be >= 0")


@dataclass
class ResumePoint:
    """The checkpoint a run continues from, as ``engine.load_checkpoint`` takes it."""

    load_dir: Path
    tag: str


class Checkpointer:
    """Owns saving (its cadence: the loop calls ``maybe_save`` after every step and ``save`` at the end)
    and resuming (:meth:`prepare_resume` before the engine exists, :meth:`resume` after)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        every_n_steps: int,
        every_n_epochs: int,
        keep_last: int,
        rank: int,
        most_recent: bool = False,
    ):
        self.run_dir = run_dir
        self.dir = run_dir / "checkpoints"
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self.rank = rank
        self.most_recent = most_recent  # OpenCLIP --save-most-recent: a checkpoint at every epoch end
        self.last_saved_step: int | None = None
        self._recent_only: str | None = None  # the tag saved only because of most_recent, removed by the next
        self.resume_point: ResumePoint | None = None

    @classmethod
    def from_args(cls, args: CheckpointArgs, run_dir: Path, *, rank: int) -> Checkpointer:
        return cls(
            run_dir,
            every_n_steps=args.save_every_n_steps,
            every_n_epochs=args.save_frequency,
            keep_last=args.keep_last,
            rank=rank,
            most_recent=args.save_most_recent,
        )

    def prepare_resume(self, resume: str | None, *, world_size: int) -> dict[str, Any]:
        """Find the checkpoint ``--resume`` names and make it loadable on ``world_size`` ranks.

        Returns what loading it needs in the DeepSpeed config (``{}``, or ``{"checkpoint":
        {"load_universal": True}}`` when it was saved on another number of ranks and is converted
        to a universal checkpoint here), so the caller folds it in before the config is written
        and handed to DeepSpeed. Collective (every rank calls it; rank 0 converts)."""
        found = resolve_resume(resume, self.run_dir) if resume else None
        if found is None:
            return {}
        if not universal.needs_universal(universal.saved_state(*found), world_size):
            self.resume_point = ResumePoint(*found)
            return {}
        self.resume_point = ResumePoint(*universal.prepare_universal(*found, rank=self.rank))
        return {"checkpoint": {"load_universal": True}}

    def resume(self, engine, *, global_batch: int, steps_per_epoch: int) -> int:
        """Load the prepared checkpoint into ``engine`` (collective); return the optimizer step to continue
        from (0 without one). Same global batch: the saved step; otherwise the same place in the data and
        the LR schedule re-positioned there (the rule is in dsclip.checkpoint.universal)."""
        point = self.resume_point
        if point is None:
            return 0
        state = load(engine, point.load_dir, point.tag)
        start_step, moved = universal.resume_position(state, global_batch=global_batch, steps_per_epoch=steps_per_epoch)
        if moved:
            universal.set_schedule_step(engine, start_step)
        if self.rank == 0:
            print(f"resumed from {point.load_dir / point.tag} at step {start_step}", flush=True)
        return start_step

    def due(self, step: int, *, epoch_end: bool, epoch: int) -> bool:
        return self._due_by_cadence(step, epoch_end=epoch_end, epoch=epoch) or (epoch_end and self.most_recent)

    def _due_by_cadence(self, step: int, *, epoch_end: bool, epoch: int) -> bool:
        if self.every_n_steps and step % self.every_n_steps == 0:
            return True
        return bool(epoch_end and self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0)

    def maybe_save(self, engine, step: int, state: dict[str, Any], *, epoch_end: bool, epoch: int) -> bool:
        if self.last_saved_step == step or not self.due(step, epoch_end=epoch_end, epoch=epoch):
            return False
        recent_only = not self._due_by_cadence(step, epoch_end=epoch_end, epoch=epoch)
        self.save(engine, step, state)
        self._recent_only = tag_for_step(step) if recent_only else None
        return True

    def save(self, engine, step: int, state: dict[str, Any]) -> Path:
        """Collective: every rank must call it (DeepSpeed writes each rank's shards)."""
        tag = tag_for_step(step)
        tag_dir = self.dir / tag
        partial = PARTIAL_PREFIX + tag
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()  # of saves or prunes a kill interrupted
        barrier()
        engine.save_checkpoint(str(self.dir), tag=partial, client_state={"dsclip": state}, save_latest=False)
        barrier()  # every rank's shards are on disk
        if self.rank == 0:
            self._complete(self.dir / partial, step, state, getattr(getattr(engine, "module", None), "config", None))
        barrier()
        self.last_saved_step = step
        return tag_dir

    def _complete(self, part_dir: Path, step: int, state: dict[str, Any], model_cfg: dict | None) -> None:
        """Rank 0, all shards written: add dsclip's files and COMPLETE, swap the tag in, point ``latest`` at it."""
        tag = tag_for_step(step)
        tag_dir = self.dir / tag
        _atomic_write(part_dir / STATE_FILE, json.dumps(state, indent=2))
        if isinstance(model_cfg, dict):
            _atomic_write(part_dir / MODEL_CONFIG_FILE, json.dumps({"model_cfg": model_cfg}, indent=2))
        _atomic_write(part_dir / COMPLETE, json.dumps({"step": step}))
        if tag_dir.exists():  # re-saving a tag: move the old one aside, then swap the new one in
            os.replace(tag_dir, self.dir / (TRASH_PREFIX + tag))
        os.replace(part_dir, tag_dir)
        _fsync_dir(self.dir)
        _atomic_write(self.dir / LATEST, tag)
        if self._recent_only and self._recent_only != tag:  # OpenCLIP overwrites epoch_latest.pt
            self._remove_tag(self._recent_only)
        self._prune(keep=tag)
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        for p in self.dir.iterdir():
            if p.is_dir() and (p.name.startswith(PARTIAL_PREFIX) or p.name.startswith(TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep: str) -> None:
        if self.keep_last <= 0:
            return
        tags = [t for t in complete_tags(self.dir) if t <= keep]
        for old in tags[: -self.keep_last]:
            self._remove_tag(old)

    def _remove_tag(self, tag: str) -> None:
        if not (self.dir / tag).is_dir():
            return
        trash = self.dir / (TRASH_PREFIX + tag)
        os.replace(self.dir / tag, trash)  # atomic: it stops being a complete tag before any file goes
        shutil.rmtree(trash, ignore_errors=True)


def load(engine, ckpt_dir: Path, tag: str, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load a tag into the engine (collective); return dsclip's client state."""
    if engine.load_universal_checkpoint():  # saved on another world size (dsclip.checkpoint.universal)
        path, client_state = universal.load_universal(engine, ckpt_dir, tag)
    else:
        path, client_state = engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
        )
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    state = (client_state or {}).get("dsclip")
    if state is None:
        state = json.loads((ckpt_dir / tag / STATE_FILE).read_text())
    return state
