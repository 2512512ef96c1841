"""Step-granular DeepSpeed checkpoints that a crash or kill can never corrupt.

Layout of ``<run>/checkpoints/``::

    step_000000120/            one DeepSpeed tag (all ranks' shards + dsclip_state.json)
    step_000000120/COMPLETE    written by rank 0 only after every rank finished writing
    latest                     the newest COMPLETE tag; replaced atomically (DeepSpeed tools read it)

DeepSpeed's own ``latest`` file is written at the end of ``save_checkpoint`` without a
completeness check across ranks and without an atomic rename, so we switch it off
(``save_latest=False``) and write it ourselves once the tag is complete. ``--resume latest``
only ever sees complete checkpoints; pruning (``--keep-last``) happens after the new one is
complete, and only removes complete tags older than it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

COMPLETE = "COMPLETE"
LATEST = "latest"
STATE_FILE = "dsclip_state.json"


def tag_for_step(step: int) -> str:
    return f"step_{step:09d}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def complete_tags(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and (p / COMPLETE).exists()]
    return sorted(tags)


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
    if p.is_dir() and any(p.glob("*/mp_rank_*_model_states.pt")) or (p / LATEST).exists():
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint there (an interrupted save?)")
    raise FileNotFoundError(f"--resume {resume}: not a checkpoint, checkpoints folder or run folder")


class Checkpointer:
    """Owns its cadence: the loop calls ``maybe_save`` after every step and ``save`` at the end."""

    def __init__(self, run_dir: Path, *, every_n_steps: int, every_n_epochs: int, keep_last: int, rank: int):
        self.dir = run_dir / "checkpoints"
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self.rank = rank
        self.last_saved_step: int | None = None

    def due(self, step: int, *, epoch_end: bool, epoch: int) -> bool:
        if self.every_n_steps and step % self.every_n_steps == 0:
            return True
        return bool(epoch_end and self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0)

    def maybe_save(self, engine, step: int, state: dict[str, Any], *, epoch_end: bool, epoch: int) -> bool:
        if self.last_saved_step == step or not self.due(step, epoch_end=epoch_end, epoch=epoch):
            return False
        self.save(engine, step, state)
        return True

    def save(self, engine, step: int, state: dict[str, Any]) -> Path:
        """Collective: every rank must call it (DeepSpeed writes each rank's shards)."""
        tag = tag_for_step(step)
        tag_dir = self.dir / tag
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            (tag_dir / COMPLETE).unlink(missing_ok=True)  # re-saving a tag: not complete until done again
        _barrier()
        engine.save_checkpoint(str(self.dir), tag=tag, client_state={"dsclip": state}, save_latest=False)
        _barrier()  # every rank's shards are on disk
        if self.rank == 0:
            _atomic_write(tag_dir / STATE_FILE, json.dumps(state, indent=2))
            _atomic_write(tag_dir / COMPLETE, json.dumps({"step": step}))
            _atomic_write(self.dir / LATEST, tag)
            self._prune(keep=tag)
        _barrier()
        self.last_saved_step = step
        return tag_dir

    def _prune(self, keep: str) -> None:
        if self.keep_last <= 0:
            return
        tags = [t for t in complete_tags(self.dir) if t <= keep]
        for old in tags[: -self.keep_last]:
            shutil.rmtree(self.dir / old, ignore_errors=True)


def load(engine, ckpt_dir: Path, tag: str, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load a tag into the engine (collective); return dsclip's client state."""
    path, client_state = engine.load_checkpoint(
        str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
    )
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    state = (client_state or {}).get("dsclip")
    if state is None:
        state = json.loads((ckpt_dir / tag / STATE_FILE).read_text())
    return state
