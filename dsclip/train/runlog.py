"""The run folder's text log, code snapshot (OpenCLIP's --log-local, --debug, --copy-codebase) and exit status.

Rank 0 writes ``RUN/out.log``; with ``--log-local`` every rank writes ``RUN/out-RANK.log`` (what
OpenCLIP does), which is where a rank's own warnings go when only one rank misbehaves. The file gets
every ``dsclip`` log record and the rank's console lines (:func:`dsclip.console.say`: the checks before
the process group, the rank line, the run header, the step lines, checkpoints, evaluations, the summary).
It is attached right after the run folder's lock; the lines said before it (kept by dsclip.console) are
written into it first.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import dsclip
from dsclip import console
from dsclip.checkpoint.ds_checkpoint import atomic_write
from dsclip.config_base import ConfigError
from dsclip.train.metrics import LogArgs

FORMAT = "%(asctime)s | rank %(rank)s | %(levelname)s | %(name)s | %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def log_file(run_dir: Path, rank: int, log_local: bool) -> Path | None:
    if log_local:
        return run_dir / f"out-{rank}.log"
    return run_dir / "out.log" if rank == 0 else None


def setup(log: LogArgs, run_dir: Path, rank: int) -> logging.Handler | None:
    """Attach this rank's log file to the ``dsclip`` logger; DEBUG level with ``--debug``."""
    logger = logging.getLogger("dsclip")
    logger.setLevel(logging.DEBUG if log.debug else logging.INFO)
    path = log_file(run_dir, rank, log.log_local)
    if path is None:
        console.take_early()  # this rank writes no file: stop keeping its lines
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RankFilter(rank))
    setattr(handler, console.RUN_LOG, True)
    # dsclip.console (the console lines) does not propagate, so that a root console handler does not
    # print them twice: it gets the file handler itself.
    for lg in (logger, console.LOGGER):
        # A second run in the same process (tests, notebooks) must not write into the first run's file.
        for old in [h for h in lg.handlers if getattr(h, console.RUN_LOG, False)]:
            lg.removeHandler(old)
            old.close()
        lg.addHandler(handler)
    # the lines said before the run folder existed (checks, rank line, world set-up) go first, in order
    for record in console.take_early():
        handler.handle(record)
    logger.debug("logging to %s", path)
    return handler


def copy_codebase(run_dir: Path, *, resuming: bool) -> Path:
    """Copy the dsclip package that is running into ``RUN/code/dsclip`` (rank 0 only calls it).

    A resumed run keeps the copy its first start made (a requeued job must not fail here); a new run
    whose folder already has one is refused, as OpenCLIP does."""
    src = Path(dsclip.__file__).resolve().parent
    dst = run_dir / "code" / "dsclip"
    if dst.exists():
        if resuming:
            return dst
        raise ConfigError(f"{dst} already exists: --copy-codebase needs a new run (--name) or --resume")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


EXIT_STATUS = "exit_status.json"


def write_exit_status(
    run_dir: Path, *, exit_code: int, stop: str | None, step: int, checkpoint: str | None, goodput: dict | None = None
) -> Path:
    """``RUN/exit_status.json``: how this start of the run ends, written by rank 0 once its last checkpoint
    is safe (before the final evaluations, while no rank can have exited yet).

    The batch scripts read it because srun's own exit code cannot say it: with --kill-on-bad-exit the
    first rank to exit 85 (saved after SIGUSR1, requeue me) makes srun SIGTERM the ranks still tearing
    down, and srun then reports their 143. The scripts delete the file before each start, so a missing
    file means that start crashed or was killed before it finished. Atomic (rename), so a reader never
    sees half of it. ``goodput``: the run's wall time by kind, summed over its starts (dsclip.train.goodput);
    a finished start writes the file again after its final evaluations, with the goodput up to its end line."""
    path = run_dir / EXIT_STATUS
    status = {"exit_code": exit_code, "stop": stop or "finished", "step": step, "checkpoint": checkpoint}
    if goodput is not None:
        status["goodput"] = goodput
    atomic_write(path, json.dumps(status) + "\n")
    return path
