"""A run folder that holds checkpoints is never started over by accident (issue 52).

The same ``--name`` without ``--resume`` used to start at step 1 in the old folder: its checkpoints
were replaced (with another ``--seed`` the original weights were gone) and ``metrics.jsonl``,
``out.log`` and ``results.jsonl`` got a second history appended to the first. open_clip_train refuses
an existing experiment; dsclip refuses a folder that holds a checkpoint, in one line naming the latest
step and the two ways on, before anything is written. A folder without a checkpoint (a run that failed
at its start) is reused, with one line, its leftovers cleared so that no log holds two histories.

``--overwrite`` (dsclip's own flag; OpenCLIP has none) starts such a folder over on purpose: the old
run's files are deleted, checkpoints first (the folder is renamed aside before it is removed, so a kill
during the deletion never leaves a tag that still looks complete), never mixed with the new run's.
Only the run lock (:mod:`dsclip.checkpoint.run_lock`, already held) stays.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsclip.checkpoint.ds_checkpoint import _step_of, latest_complete
from dsclip.checkpoint.layout import TRASH_PREFIX
from dsclip.checkpoint.run_lock import LOCK_FILE
from dsclip.config_base import ConfigError


def _leftovers(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name != LOCK_FILE)


def check_new_run(run_dir: Path, *, resume: str | None, overwrite: bool, say) -> None:
    """Rank 0, holding the run lock, before anything of the run is written. ``--resume`` (any form): the
    folder is continued (nothing here). Otherwise a checkpoint in it is a ConfigError unless ``overwrite``;
    whatever else is in it is cleared, with one line through ``say``."""
    if resume is not None:
        return
    latest = latest_complete(run_dir / "checkpoints")
    if latest is not None and not overwrite:
        raise ConfigError(
            f"run folder {run_dir} already holds checkpoints (latest: step {_step_of(latest)}, {latest}); "
            "continue it with --resume latest, or choose another --name (--overwrite deletes it and starts over)"
        )
    old = _leftovers(run_dir)
    if not old:
        return
    if latest is not None:
        say(f"dsclip: --overwrite: deleting the earlier run in {run_dir} (latest checkpoint {latest}) to start over")
    elif overwrite:
        say(f"dsclip: --overwrite: clearing {run_dir} (no checkpoint in it) to start over")
    else:
        names = ", ".join(p.name for p in old[:4]) + (", ..." if len(old) > 4 else "")
        say(
            f"dsclip: run folder {run_dir} holds no checkpoint, only an earlier start's files ({names}); "
            "reusing it, those files replaced"
        )
    for p in sorted(old, key=lambda p: p.name != "checkpoints"):  # checkpoints first: no tag outlives its logs
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        trash = p.with_name(TRASH_PREFIX + p.name)
        os.replace(p, trash)  # atomic: no complete-looking tag is left half-deleted by a kill
        shutil.rmtree(trash)
    else:
        p.unlink()
