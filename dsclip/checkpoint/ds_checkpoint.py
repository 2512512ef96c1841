"""Step-granular DeepSpeed checkpoints that a crash or kill can never corrupt.

Layout of ``<run>/checkpoints/``::

    step_000000120/                    one DeepSpeed tag (all ranks' shards + dsclip_state.json
                                       + model_config.json)
    step_000000120/COMPLETE            written by rank 0 only after every rank finished writing
    step_000000120/MANIFEST.json       every file of the tag, its size and crc32, written last
                                       (dsclip.checkpoint.manifest)
    step_000000120/universal/          a world-size-independent copy, made on demand when a run
                                       resumes on a different number of ranks (dsclip.checkpoint.universal)
    latest                             the newest COMPLETE tag; replaced atomically (DeepSpeed tools read it)
    .partial.step_000000120/           a save in progress (never read; removed by the next save)

A save writes every rank's shards into ``.partial.<tag>``, then rank 0 adds the dsclip state, the
model config, ``COMPLETE`` and the manifest and renames the folder to ``<tag>`` (one atomic rename), and only
then points ``latest`` at it. So a folder named ``step_*`` is always complete, whenever the job is
killed, and re-saving a tag that ``latest`` names (a preempted run saving again at the step it
resumed from) never leaves ``latest`` pointing at half-written shards.

DeepSpeed's own ``latest`` file is written at the end of ``save_checkpoint`` without a
completeness check across ranks and without an atomic rename, so we switch it off
(``save_latest=False``) and write it ourselves once the tag is complete. ``--resume latest``
only ever sees complete checkpoints; pruning (``--keep-last``) happens after the new one is
complete, and only removes complete tags older than it (each is first renamed out of the way, so
a kill during the deletion never leaves a half-deleted folder that still looks complete).

With ``--async-save`` (dsclip.checkpoint.async_save) a save returns once each rank's state is copied to
host memory; each rank's files are written into ``.partial.<tag>`` by a background thread, and the same
completion (manifest, rename, ``latest``) runs as a collective on the main thread at the first step
boundary at which no rank is still writing (:meth:`Checkpointer.after_step`), or when the run's end, a stop
signal, the divergence guard or the next save waits for it (:meth:`Checkpointer.drain`).

What the file system did to a tag after its save (flipped bytes, a truncated or deleted shard) is
caught on resume: each rank checks the files it will load against the manifest (the ranks agree), and
``--resume latest`` (or a run or checkpoints folder) skips a tag that fails, with one line naming the
file, for the newest tag that verifies; an explicit tag that fails is a one-line error. A tag written by
an older dsclip has no manifest: it is used, reported as unverified. A full disk during a save is one
line naming the path (:class:`DiskFullError`); the half-written ``.partial`` folder is removed and
``latest`` stays on the previous tag.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsclip.checkpoint import manifest, model_match, resume_optim, universal
from dsclip.checkpoint.diskfull import DiskFullError, DiskFullGuard, is_disk_full
from dsclip.checkpoint.layout import (
    COMPLETE,
    DIVERGED,
    LATEST,
    MANIFEST,
    MODEL_CONFIG_FILE,
    PARTIAL_PREFIX,
    STATE_FILE,
    TOKENIZER_FILE,
    TOKENIZER_SPEC_FILE,
    TRASH_PREFIX,
)
from dsclip.config_base import ConfigError, opt
from dsclip.console import say
from dsclip.dist import all_ranks, barrier, from_rank0

_TAG_RE = re.compile(r"step_\d+")


def tag_for_step(step: int) -> str:
    return f"step_{step:09d}"


def atomic_write(path: Path, text: str) -> None:
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
        atomic_write(run_dir / TOKENIZER_SPEC_FILE, json.dumps({"tokenizer": spec}))


def latest_complete(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names if it is complete, else the newest complete tag (or None). Structure only:
    :func:`newest_verified` also checks the files."""
    tags = candidate_tags(ckpt_dir)
    return tags[0] if tags else None


def candidate_tags(ckpt_dir: Path) -> list[str]:
    """Complete tags in the order a resume tries them: the one ``latest`` names, then the others newest first."""
    tags = complete_tags(ckpt_dir)[::-1]
    pointer = ckpt_dir / LATEST
    if pointer.is_file():
        named = pointer.read_text().strip()
        if named in tags:
            tags.remove(named)
            tags.insert(0, named)
    return tags


def _step_of(tag: str) -> int:
    return int(tag.split("_")[1])


def diverged_note(tag_dir: Path) -> str | None:
    """Why ``tag_dir`` is not to be resumed: a run diverged from its weights (see Checkpointer.mark_diverged)."""
    marker = tag_dir / DIVERGED
    if not marker.is_file():
        return None
    try:
        first = json.loads(marker.read_text()).get("first_bad_step", "?")
    except (OSError, ValueError, AttributeError):
        first = "?"
    return f"marked {DIVERGED} (the run trained on from its weights and diverged at step {first})"


def _usable(tag_dir: Path) -> bool:
    """A fallback worth keeping: not marked diverged, and its files have their manifest's sizes."""
    return diverged_note(tag_dir) is None and manifest.verify(tag_dir, checksums=False).ok


def _say(msg: str) -> None:
    say(msg)  # console and RUN/out.log


def _unverified_note(tag_dir: Path) -> str:
    return f"dsclip: checkpoint {tag_dir} is unverified (no manifest: written by an older dsclip); using it as it is"


def newest_verified(
    ckpt_dir: Path, *, say: Callable[[str], None] = _say, check: Callable[[Path], manifest.Verdict] = manifest.verify
) -> str | None:
    """The first of :func:`candidate_tags` that verifies against its manifest; every tag skipped on the way
    is one line through ``say`` naming the file and what is wrong with it. None when there is no complete
    tag (a fresh start); ConfigError when there are some and none verifies (starting from scratch beside
    them would silently throw the run away)."""
    tags = candidate_tags(ckpt_dir)
    for tag in tags:
        note = diverged_note(ckpt_dir / tag)
        if note:
            say(f"dsclip: checkpoint {ckpt_dir / tag} skipped: {note}; trying the previous one")
            continue
        verdict = check(ckpt_dir / tag)
        if verdict.unverified:
            say(_unverified_note(ckpt_dir / tag))
        if verdict.ok:
            return tag
        say(f"dsclip: checkpoint {ckpt_dir / tag} skipped: {verdict.problem}; trying the previous one")
    if tags:
        raise ConfigError(
            f"none of the {len(tags)} checkpoints in {ckpt_dir} verifies (each is named above with what is "
            "wrong); move that folder away to start the run from scratch"
        )
    return None


def _newest(ckpt_dir: Path, verify: bool, say, check=manifest.verify) -> tuple[Path, str] | None:
    tag = newest_verified(ckpt_dir, say=say, check=check) if verify else latest_complete(ckpt_dir)
    return None if tag is None else (ckpt_dir, tag)


RESUME_FIX = (
    "choose an earlier tag ({earlier}), or --resume latest (or the run folder) to take the newest checkpoint "
    "that verifies"
)


def verify_tag(
    tag_dir: Path,
    what: str,
    *,
    fix: str = RESUME_FIX,
    say: Callable[[str], None] = _say,
    check: Callable[[Path], manifest.Verdict] = manifest.verify,
) -> None:
    """One named tag (``--resume PATH/TAG``, ``dsclip convert``): a tag that fails its manifest is a
    one-line ConfigError naming the file, what is wrong and ``fix`` (``{earlier}``: the complete tags
    before it, newest first); an unverified one (older dsclip) is one line through ``say``."""
    note = diverged_note(tag_dir)
    verdict = check(tag_dir) if note is None else manifest.Verdict(note)
    if verdict.unverified:
        say(_unverified_note(tag_dir))
    if verdict.ok:
        return
    earlier = sorted((t for t in complete_tags(tag_dir.parent) if t < tag_dir.name), reverse=True)
    listed = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "") or f"none in {tag_dir.parent}"
    failed = "is not to be used" if note else "fails verification"
    where = f"{what}: " if what else ""  # the CLI's error line already names the command (dsclip convert)
    raise ConfigError(f"{where}checkpoint {tag_dir} {failed}: {verdict.problem}; {fix.format(earlier=listed)}")


def resolve_resume(
    resume: str,
    run_dir: Path,
    *,
    verify: bool = True,
    say: Callable[[str], None] = _say,
    check: Callable[[Path], manifest.Verdict] = manifest.verify,
) -> tuple[Path, str] | None:
    """``--resume`` -> (checkpoint dir, tag), or None when 'latest' finds nothing (fresh start).

    Accepts 'latest', a checkpoints dir, a run dir, the ``latest`` file DeepSpeed writes in a checkpoints
    dir (OpenCLIP users paste it), or a tag dir (``.../step_000000120``). ``verify``: check the files
    against the manifest with ``check`` (default: the whole tag read here; a resume: each rank its share,
    Checkpointer._agreed_verdict) and fall back past damaged tags, except for a tag dir, which must verify.
    Without ``verify``, structure only (COMPLETE markers).
    """
    if resume == "latest":
        return _newest(run_dir / "checkpoints", verify, say, check)
    p = Path(resume)
    if p.name == LATEST and p.is_file():  # RUN/checkpoints/latest: the same as that run's --resume latest
        found = _newest(p.parent, verify, say, check)
        if found is None:
            raise FileNotFoundError(f"--resume {resume}: no complete checkpoint in {p.parent} (an interrupted save?)")
        return found
    if (p / COMPLETE).exists():
        if verify:
            verify_tag(p, f"--resume {resume}", say=say, check=check)
        return p.parent, p.name
    for ckpt_dir in (p, p / "checkpoints"):
        if complete_tags(ckpt_dir):
            return _newest(ckpt_dir, verify, say, check)
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
    max_skipped_steps: int = opt(
        20,
        "Stop the run (exit code 2) after N consecutive optimizer steps that were skipped, had a non-finite "
        "loss or broke a --divergence-* bound (0: never). No checkpoint is saved from such steps, latest is "
        "left on the last checkpoint whose weights a later healthy step trained on, and a run whose last step "
        "is non-finite or unhealthy also ends with exit code 2.",
    )
    divergence_window: int = opt(
        50,
        "Divergence rule: a finite loss above median + K x MAD (at least 0.05 x the median) of the last N "
        "healthy losses is unhealthy (needs 10 of them; 0: no loss bound). docs/checkpoints.md.",
    )
    divergence_k: float = opt(6.0, "Divergence rule: K of --divergence-window's bound (> 0).")
    divergence_min_scale: float = opt(
        1.0, "Divergence rule: a logit scale (exp of logit_scale) below this is unhealthy (>= 0; 0: off)."
    )
    divergence_scale_step: float = opt(
        0.05,
        "Divergence rule: a step that moves log(logit scale) by more than this is unhealthy (> 0; healthy "
        "AdamW steps move it by about the learning rate).",
    )
    overwrite: bool = opt(
        False,
        "dsclip's own flag (OpenCLIP has none): start over in a run folder (--name) that already holds "
        "checkpoints, deleting that run's checkpoints and logs first. Without it such a folder is refused "
        "unless --resume is given.",
    )
    async_save: bool = opt(
        True,
        "dsclip's own flag: the step loop stops only while this rank's checkpoint state is copied to host "
        "memory; the files are written in the background and latest moves once every rank's are complete "
        "(--no-async-save: the whole write stalls every rank). docs/checkpoints.md.",
    )
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
        if self.max_skipped_steps < 0:
            raise ConfigError(f"'max_skipped_steps' must be >= 0 (0: never stop), got {self.max_skipped_steps}")
        bounds = (
            ("divergence_window", self.divergence_window, self.divergence_window >= 0, ">= 0 (0: no loss bound)"),
            ("divergence_k", self.divergence_k, self.divergence_k > 0, "> 0"),
            ("divergence_min_scale", self.divergence_min_scale, self.divergence_min_scale >= 0, ">= 0 (0: off)"),
            ("divergence_scale_step", self.divergence_scale_step, self.divergence_scale_step > 0, "> 0"),
        )
        for name, value, ok, want in bounds:
            if not (ok and math.isfinite(value)):
                raise ConfigError(f"--{name.replace('_', '-')} must be {want}, got {value} (docs/checkpoints.md)")


class CheckpointWriteError(ConfigError):
    """A background checkpoint write failed for a reason other than a full disk (one line; latest kept)."""


@dataclass
class _SaveJob:
    """One save between its start and its tag's completion (``write``: the background write, when async)."""

    step: int
    partial: str
    state: dict[str, Any]
    model_cfg: dict | None
    times: Any
    recent_only: str | None = None  # the --save-most-recent tag this save replaces (Checkpointer._complete)
    write: Any = None


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
        async_save: bool = False,
    ):
        self.run_dir = run_dir
        self.dir = run_dir / "checkpoints"
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self.rank = rank
        self.most_recent = most_recent  # OpenCLIP --save-most-recent: a checkpoint at every epoch end
        self.last_saved_step: int | None = None
        self.saving_step: int | None = None  # the step whose save is under way
        self._recent_only: str | None = None  # the tag saved only because of most_recent, removed by the next
        self.resume_point: ResumePoint | None = None
        # tags up to this step hold weights that a later step trained on with a finite loss (certify)
        self.certified_through = -1
        self._pending_prune: str | None = None  # a tag whose prune waits for the tag to be confirmed (certify)
        self._deferred_removal: tuple[str, str] | None = None  # (a --save-most-recent tag, the tag it waits for)
        # per-rank state saved beside DeepSpeed's shards in the same tag (the sharded EMA: dsclip.engine.ema)
        self.rank_state: dict[str, Any] = {}
        self.async_save = async_save  # --async-save: files written in the background (dsclip.checkpoint.async_save)
        self.in_flight: _SaveJob | None = None  # the save whose background write is not yet complete
        # what every save cost this rank (dsclip.checkpoint.async_save.SaveTimes), oldest first: goodput reads it
        self.save_times: list = []
        # called on rank 0 with the tag's folder once a tag is complete (renamed into place, latest moved)
        self.on_complete: list[Callable[[Path], None]] = []
        self.verify_s = 0.0  # seconds this rank spent verifying its share of the tag it resumes from

    @classmethod
    def from_args(cls, args: CheckpointArgs, run_dir: Path, *, rank: int) -> Checkpointer:
        return cls(
            run_dir,
            every_n_steps=args.save_every_n_steps,
            every_n_epochs=args.save_frequency,
            keep_last=args.keep_last,
            rank=rank,
            most_recent=args.save_most_recent,
            async_save=args.async_save,
        )

    def prepare_resume(self, resume: str | None, *, world_size: int) -> dict[str, Any]:
        """Find the checkpoint ``--resume`` names and make it loadable on ``world_size`` ranks.

        Returns what loading it needs in the DeepSpeed config (``{}``, or ``{"checkpoint":
        {"load_universal": True}}`` when it was saved on another number of ranks and is converted
        to a universal checkpoint here), so the caller folds it in before the config is written
        and handed to DeepSpeed. Collective (every rank calls it; rank 0 converts)."""
        if self.rank == 0 and self.dir.is_dir():
            # a save killed mid-write left its .partial (maybe what filled the disk): gone before anything
            # needs the space. Safe: this process holds the run lock (run_lock), so no live save owns it.
            self._remove_leftovers()
        found = self._resolve(resume) if resume else None
        if found is None:
            if resume is not None and self.rank == 0:  # 'latest' with nothing yet: right for a first launch
                say(f"dsclip: --resume {resume}: no checkpoint in {self.dir} yet; starting the run from step 0")
            return {}
        if not universal.needs_universal(universal.saved_state(*found), world_size):
            self.resume_point = ResumePoint(*found)
            return {}
        self.resume_point = ResumePoint(*universal.prepare_universal(*found, rank=self.rank))
        return {"checkpoint": {"load_universal": True}}

    def check_model(self, model_cfg: dict, model_name: str) -> None:
        """Before anything is written: the checkpoint to resume was trained as ``model_cfg`` (this run's
        resolved architecture), else one ConfigError line naming both models (every rank reads the tag's
        small model_config.json, so every rank raises it)."""
        if self.resume_point is not None:
            model_match.check_resumed_model(self.resume_point.load_dir / self.resume_point.tag, model_cfg, model_name)

    def _resolve(self, resume: str) -> tuple[Path, str] | None:
        """Every rank walks the same tags (the checkpoint folder is shared: every rank loads from it) and
        verifies, for each tag it considers, only the files it will load, in parallel with the others
        (:meth:`_agreed_verdict`); rank 0's answer (or error) is every rank's."""
        found = error = None
        quiet = _say if self.rank == 0 else (lambda m: None)
        try:
            found = resolve_resume(resume, self.run_dir, say=quiet, check=self._agreed_verdict)
        except (ConfigError, FileNotFoundError) as e:
            error = e
        found, error = from_rank0((found, error))
        if error is not None:
            raise error
        return found

    def _agreed_verdict(self, tag_dir: Path) -> manifest.Verdict:
        """Collective: this rank checks every file's size and the checksums of the files it loads
        (manifest.loading_rank; rank 0: the module file and the small shared ones); the first problem any
        rank found is every rank's verdict (so a bad file on one rank is the same one line on all)."""
        from dsclip.dist import rank_world

        rank, world = rank_world()
        t0 = time.perf_counter()
        mine = manifest.verify(tag_dir, owned=lambda rel: manifest.loading_rank(rel, world) == rank)
        self.verify_s = time.perf_counter() - t0  # this rank's share (bench/save_stall.py reads it)
        verdicts = all_ranks((mine.problem, mine.unverified))
        problem = next((p for p, _ in verdicts if p is not None), None)
        return manifest.Verdict(problem, unverified=problem is None and verdicts[0][1])

    def resume(self, engine, *, global_batch: int, steps_per_epoch: int, optim: dict | None = None) -> int:
        """Load the prepared checkpoint into ``engine`` (collective); return the optimizer step to continue
        from (0 without one). Same global batch: the saved step; otherwise the same place in the data and
        the LR schedule re-positioned there (the rule is in dsclip.checkpoint.universal). ``optim``: this
        run's optimizer settings (resume_optim.recorded); where they differ from the checkpoint's, this
        run's are applied, in one line (dsclip.checkpoint.resume_optim)."""
        point = self.resume_point
        if point is None:
            return 0
        built = resume_optim.snapshot(engine)
        if optim is not None:
            resume_optim.check_layer_decay(universal.saved_state(point.load_dir, point.tag).get("optim"), optim)
        from dsclip.checkpoint.safe_load import data_only

        with data_only():  # DeepSpeed's loads, its universal ones (torch.load of their own) too: data only
            state = load(engine, point.load_dir, point.tag)
        start_step, moved = universal.resume_position(state, global_batch=global_batch, steps_per_epoch=steps_per_epoch)
        if moved:
            universal.set_schedule_step(engine, start_step)
        if self.rank == 0:
            say(f"resumed from {point.load_dir / point.tag} at step {start_step}")
        if optim is not None:
            resume_optim.reconcile(
                engine, built, state.get("optim"), optim, start_step, say=_say if self.rank == 0 else lambda m: None
            )
        with data_only():
            self._load_rank_state(point, universal=bool(engine.load_universal_checkpoint()))
        # the tags before the one resumed from were confirmed by the run that saved it (see certify)
        self.certified_through = start_step - 1
        return start_step

    def _load_rank_state(self, point: ResumePoint, *, universal: bool) -> None:
        """Each rank's own file of every ``rank_state`` owner, bit for bit. Saved on another number of ranks
        (a universal resume): every rank reads all the saved ranks' files and takes its new share
        (``load_resharded``), bit for bit too. A tag without such files (saved without EMA) starts the owner
        from the resumed weights, in one line."""
        import torch

        tag_dir = point.load_dir if universal else point.load_dir / point.tag  # universal: load_dir is the tag
        for name, owner in self.rank_state.items():
            files = sorted(tag_dir.glob(f"{name}_rank*.pt"))
            if not files:
                if self.rank == 0:
                    say(f"{name}: {tag_dir} holds none (saved without it); it starts from the resumed weights")
                owner.restart()
                continue
            own = tag_dir / rank_file(name, self.rank)
            try:
                if not universal and own.is_file():
                    owner.load_state_dict(torch.load(own, map_location="cpu", weights_only=True))
                else:
                    owner.load_resharded([torch.load(f, map_location="cpu", weights_only=True) for f in files])
                    if self.rank == 0:
                        say(f"{name}: resharded from the {len(files)} ranks that saved it")
            except ValueError as e:
                raise ConfigError(f"{tag_dir}: {e}") from None

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
        """Collective: every rank must call it (DeepSpeed writes each rank's shards). Asynchronous
        (``async_save``): returns once this rank's state is copied to host memory; the files are written in
        the background and the tag is completed by :meth:`after_step` or :meth:`drain`. At most one write is
        in flight: a save that comes while one is still writing waits for it first (its ``wait_s``)."""
        from dsclip.checkpoint.async_save import BackgroundWrite, DsclipCheckpointEngine, SaveTimes

        if self.in_flight is not None:
            self._finish_in_flight()
        tag = tag_for_step(step)
        partial = PARTIAL_PREFIX + tag
        self.saving_step = step  # cleared once the tag is complete: a rank lost meanwhile is said to be mid-save
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()  # of saves or prunes a kill interrupted
        barrier()
        ce = getattr(engine, "checkpoint_engine", None)  # dsclip's, installed by the training loop
        asynchronous = self.async_save and isinstance(ce, DsclipCheckpointEngine)
        times = SaveTimes(tag, step, asynchronous=asynchronous)
        self.save_times.append(times)
        t0 = time.perf_counter()
        guard = DiskFullGuard(engine, self.dir)
        model_cfg = getattr(getattr(engine, "module", None), "config", None)
        job = _SaveJob(step, partial, state, model_cfg, times, recent_only=self._recent_only)
        if asynchronous:
            with ce.capture() as captured:  # host copies only: the step loop stops for this much
                full = guard.run(lambda: self._write(engine, partial, state))
            job.write = BackgroundWrite(captured.files, self.dir / partial, ce.write, times, error=full)
            times.stall_s = time.perf_counter() - t0
            self.in_flight, self.saving_step, self.last_saved_step = job, None, step
            return self.dir / tag
        full = guard.run(lambda: self._write(engine, partial, state))
        sums = manifest.entries(self.dir / partial, guard.written) if full is None else {}
        times.stall_s = times.write_s = time.perf_counter() - t0
        times.bytes = sum(os.path.getsize(p) for p in guard.written if os.path.isfile(p))
        self._conclude(job, None if full is None else str(full), None, sums)
        return self.dir / tag

    def _write(self, engine, partial: str, state: dict[str, Any]) -> None:
        engine.save_checkpoint(str(self.dir), tag=partial, client_state={"dsclip": state}, save_latest=False)
        for name, owner in self.rank_state.items():  # through the checkpoint engine: guarded and checksummed
            (self.dir / partial).mkdir(parents=True, exist_ok=True)
            engine.checkpoint_engine.save(owner.state_dict(), str(self.dir / partial / rank_file(name, self.rank)))

    def incomplete_step(self) -> int | None:
        """The step whose save has started and is not complete (its background write included), or None."""
        if self.saving_step is not None:
            return self.saving_step
        return None if self.in_flight is None else self.in_flight.step

    def write_busy(self) -> float:
        """1.0 while this rank's background write is running (a flag the step sums over the ranks), else 0.0."""
        return float(self.in_flight is not None and self.in_flight.write.busy)

    def after_step(self, flags) -> bool:
        """After a step (every rank, the same ``flags``: the step's summed flags, ``write_busy`` third): once no
        rank is still writing, complete the tag in flight (collective). Whether it did."""
        if self.in_flight is None or len(flags) < 3 or float(flags[2]) > 0:
            return False
        self._finish_in_flight()
        return True

    def close(self) -> None:
        """The run's last closer (dsclip.train.loop's ExitStack): on a way out that did not :meth:`drain` (an
        error, a lost rank), this rank's background write is waited for, so no thread outlives the run and no
        file is left half-written; its tag is not completed (that is collective), so it stays ``.partial`` and
        the next start removes it: ``latest`` stays on the last complete checkpoint. No-op when nothing is in
        flight."""
        job, self.in_flight = self.in_flight, None
        if job is not None:
            job.times.wait_s += job.write.wait()

    def drain(self, why: str) -> None:
        """Wait for the write in flight and complete its tag (collective), saying so in one line: the run's end,
        a stop signal and the divergence guard call it before they decide what ``latest`` is."""
        if self.in_flight is None:
            return
        if self.rank == 0:
            say(f"dsclip: waiting for the background write of checkpoint {self.in_flight.times.tag} ({why})")
        self._finish_in_flight()

    def _finish_in_flight(self) -> None:
        job, self.in_flight = self.in_flight, None
        job.times.wait_s += job.write.wait()
        error, full, failed = job.write.error, None, None
        if error is not None and is_disk_full(error, self.dir):
            full = str(error)
        elif error is not None:
            failed = f"rank {self.rank}: {type(error).__name__}: {error}".splitlines()[0]
        self.saving_step = job.step
        self._conclude(job, full, failed, job.write.sums)

    def _conclude(self, job: _SaveJob, full: str | None, failed: str | None, sums: dict) -> None:
        """Every rank's files are written (or some rank failed): rank 0 completes the tag (collective)."""
        # collective: every rank's shards are on disk (or some rank's disk was full), with their checksums
        reports = all_ranks((full, failed, sums))
        full = next((f for f, _, _ in reports if f is not None), None)
        failed = next((f for _, f, _ in reports if f is not None), None)
        if full is None and failed is None and self.rank == 0:
            known = {rel: e for _, _, rank_sums in reports for rel, e in rank_sums.items()}
            try:
                self._complete(
                    self.dir / job.partial, job.step, job.state, job.model_cfg, known, recent_only=job.recent_only
                )
            except Exception as e:
                if not is_disk_full(e, self.dir):
                    raise
                full = str(e)
        full = from_rank0(full)  # collective: the tag is complete (or not) for every rank
        self.saving_step = None
        if full is not None:
            self._fail_disk_full(self.dir / job.partial)
        if failed is not None:
            self._fail_write(self.dir / job.partial, failed)
        job.times.complete = True
        self.last_saved_step = job.step

    def _fail_write(self, part_dir: Path, failed: str) -> None:
        if self.rank == 0:
            shutil.rmtree(part_dir, ignore_errors=True)
        raise CheckpointWriteError(
            f"writing checkpoint {part_dir} failed ({failed}); {self._kept()}: fix the cause and continue with "
            "--resume latest"
        )

    def _kept(self) -> str:
        pointer = self.dir / LATEST
        return f"latest still names {pointer.read_text().strip()}" if pointer.is_file() else "no checkpoint was kept"

    def save_totals(self) -> dict[str, float]:
        """This rank's saves so far, summed: ``saves``, ``stall_s``, ``wait_s``, ``write_s``, ``bytes``
        (:class:`dsclip.checkpoint.async_save.SaveTimes`); time lost to training is ``stall_s + wait_s``."""
        keys = ("stall_s", "wait_s", "write_s", "bytes")
        out = {k: float(sum(getattr(t, k) for t in self.save_times)) for k in keys}
        out["saves"] = float(len(self.save_times))
        return out

    def _fail_disk_full(self, part_dir: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(part_dir, ignore_errors=True)  # its space is what the next attempt needs
        raise DiskFullError(
            f"disk full while saving checkpoint to {part_dir} ({self._kept()}): free space on that file system "
            "(e.g. --keep-last N keeps fewer checkpoints) or choose a --logs folder on a larger one"
        )

    def _complete(
        self,
        part_dir: Path,
        step: int,
        state: dict[str, Any],
        model_cfg: dict | None,
        known: dict | None = None,
        *,
        recent_only: str | None = None,
    ) -> None:
        """Rank 0, all shards written: add dsclip's files, COMPLETE and the manifest (``known``: the entries the
        ranks computed for their own shards), swap the tag in, point ``latest`` at it."""
        tag = tag_for_step(step)
        tag_dir = self.dir / tag
        atomic_write(part_dir / STATE_FILE, json.dumps(state, indent=2))
        if isinstance(model_cfg, dict):
            atomic_write(part_dir / MODEL_CONFIG_FILE, json.dumps({"model_cfg": model_cfg}, indent=2))
        # COMPLETE says a manifest belongs to the tag (so a lost one is damage, not an older dsclip's tag);
        # the manifest itself comes last, over every other file: a tag is complete only when it is
        atomic_write(part_dir / COMPLETE, json.dumps({"step": step, "manifest": MANIFEST}))
        atomic_write(part_dir / MANIFEST, manifest.build(part_dir, known))
        if tag_dir.exists():  # re-saving a tag: move the old one aside, then swap the new one in
            os.replace(tag_dir, self.dir / (TRASH_PREFIX + tag))
        os.replace(part_dir, tag_dir)
        _fsync_dir(self.dir)
        atomic_write(self.dir / LATEST, tag)
        if recent_only and recent_only != tag:  # OpenCLIP overwrites epoch_latest.pt
            if _step_of(tag) <= self.certified_through or self._newest_certified(before=tag) != recent_only:
                self._remove_tag(recent_only)
            else:  # the last confirmed tag: removed once a step confirms ``tag`` (certify)
                self._deferred_removal = (recent_only, tag)
        self._prune(keep=tag)
        self._remove_leftovers()
        self._completed(tag_dir)

    def _completed(self, tag_dir: Path) -> None:
        """Rank 0: ``tag_dir`` is complete (renamed into place, ``latest`` names it): the ``on_complete`` hooks.
        A hook that fails is one line; the checkpoint stays complete and training goes on."""
        for hook in self.on_complete:
            try:
                hook(tag_dir)
            except Exception as e:
                say(f"dsclip: after checkpoint {tag_dir.name}: {getattr(hook, '__name__', hook)} failed ({e})")

    def _remove_leftovers(self) -> None:
        for p in self.dir.iterdir():
            if p.is_dir() and (p.name.startswith(PARTIAL_PREFIX) or p.name.startswith(TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep: str) -> None:
        """Keep ``keep`` (just written and checksummed) and the newest ``keep_last - 1`` older tags that still
        match their manifest's sizes (a stat per file; a damaged tag is no fallback, so it does not take a
        place), and the newest tag whose weights are confirmed good (:meth:`certify`) while ``keep`` is not:
        remove every other tag up to ``keep``. Tags newer than ``keep`` (left by a run that resumed from an
        earlier one) are never touched."""
        if self.keep_last <= 0:
            return
        self._pending_prune = None
        good = None if _step_of(keep) <= self.certified_through else self._newest_certified(before=keep)
        kept = 1
        for old in [t for t in complete_tags(self.dir) if t < keep][::-1]:
            if kept < self.keep_last and manifest.verify(self.dir / old, checksums=False).ok:
                kept += 1
            elif old != good:
                self._remove_tag(old)
        if good is not None and kept >= self.keep_last and (self.dir / good).is_dir():
            self._pending_prune = keep  # one more than keep_last until a step confirms ``keep``

    def _newest_certified(self, before: str) -> str | None:
        for tag in complete_tags(self.dir)[::-1]:
            if tag < before and _step_of(tag) <= self.certified_through and _usable(self.dir / tag):
                return tag
        return None

    def certify(self, through: int) -> None:
        """The weights after step ``through`` are good: step ``through + 1`` trained on them with a finite loss
        (every rank calls it with the same step). So is every tag before it: a skipped step leaves the
        weights as they were. A step's own finite loss does not vouch for the weights it wrote (``--lr 1e6``:
        step 1's loss is finite, its update blows the weights up, step 2's loss is NaN), so the tag saved at
        a step waits for the next good step, and until then --keep-last keeps the previous good tag too."""
        self.certified_through = max(self.certified_through, through)
        if self.rank != 0:
            return
        pending, deferred = self._pending_prune, self._deferred_removal
        if pending is not None and _step_of(pending) <= self.certified_through:
            self._prune(keep=pending)
        if deferred is not None and _step_of(deferred[1]) <= self.certified_through:
            self._deferred_removal = None
            self._remove_tag(deferred[0])

    def mark_diverged(self, step: int, first_bad: int) -> Path | None:
        """The run diverged (steps ``first_bad``..``step`` skipped or non-finite): rank 0 marks every tag of
        this run it had not confirmed (:meth:`certify`; they hold the weights the bad steps ran on) with
        ``DIVERGED`` and points ``latest`` at the newest confirmed tag (removes it when there is none).
        Returns that tag's folder (None: no checkpoint from before the divergence)."""
        self.drain("the divergence guard stopped the run")  # its tag is marked like any unconfirmed one
        tags = complete_tags(self.dir)
        good = next((t for t in tags[::-1] if _step_of(t) <= self.certified_through and _usable(self.dir / t)), None)
        if self.rank == 0 and self.dir.is_dir():
            for tag in tags:
                if self.certified_through < _step_of(tag) <= step:
                    atomic_write(self.dir / tag / DIVERGED, json.dumps({"first_bad_step": first_bad, "step": step}))
            if good is not None:
                atomic_write(self.dir / LATEST, good)
            else:
                (self.dir / LATEST).unlink(missing_ok=True)
        barrier()
        return None if good is None else self.dir / good

    def refuse_resumed(self, why: str) -> ConfigError:
        """The tag this run resumed from holds diverged weights (``why``): rank 0 marks it ``DIVERGED`` (so
        ``--resume latest`` falls back past it next time) and points ``latest`` at the newest earlier usable
        tag; returns the one-line error naming that tag (collective)."""
        point = self.resume_point
        tag_dir = point.load_dir / point.tag
        earlier = [t for t in complete_tags(point.load_dir) if t < point.tag and _usable(point.load_dir / t)]
        good = point.load_dir / earlier[-1] if earlier else None
        if self.rank == 0:
            atomic_write(tag_dir / DIVERGED, json.dumps({"first_bad_step": _step_of(point.tag), "why": why}))
            if good is not None and point.load_dir == self.dir:
                atomic_write(self.dir / LATEST, good.name)
        barrier()
        way = (
            f"resume from {good} (--resume latest now takes it) with a lower --lr"
            if good is not None
            else "no earlier checkpoint is left: start again with a lower --lr"
        )
        return ConfigError(f"--resume: checkpoint {tag_dir} holds diverged weights ({why}); marked {DIVERGED}; {way}")

    def _remove_tag(self, tag: str) -> None:
        if not (self.dir / tag).is_dir():
            return
        trash = self.dir / (TRASH_PREFIX + tag)
        os.replace(self.dir / tag, trash)  # atomic: it stops being a complete tag before any file goes
        shutil.rmtree(trash, ignore_errors=True)


def rank_file(name: str, rank: int) -> str:
    """A rank's own file in a tag (``ema_rank00003.pt``): per-rank state DeepSpeed's files do not hold."""
    return f"{name}_rank{rank:05d}.pt"


def load(engine, ckpt_dir: Path, tag: str, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load a tag into the engine (collective); return dsclip's client state."""
    try:
        if engine.load_universal_checkpoint():  # saved on another world size (dsclip.checkpoint.universal)
            path, client_state = universal.load_universal(engine, ckpt_dir, tag)
        else:
            path, client_state = engine.load_checkpoint(
                str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
            )
    except RuntimeError as e:
        # a tag without model_config.json (older dsclip) escapes Checkpointer.check_model: torch's strict load
        # then lists every tensor (a 99-line traceback); one line with the first of them instead
        mismatch = model_match.load_mismatch(e, ckpt_dir / tag)
        if mismatch is None:
            raise
        raise mismatch from e
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    state = (client_state or {}).get("dsclip")
    if state is None:
        state = json.loads((ckpt_dir / tag / STATE_FILE).read_text())
    return state
