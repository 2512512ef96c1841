"""Trained runs shared by the CLI tests that only read them (one training per session, any xdist layout)."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
from pathlib import Path

import pytest


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_build(shared: Path, name: str, build) -> Path:
    """``shared/name``, made by ``build(path)`` exactly once per session whichever worker asks first.

    A marker file is written only after build returns, so a build that failed is retried (and fails
    again, visibly) in the next test that needs it, rather than handing out a half-made run."""
    target, done = shared / name, shared / f"{name}.done"
    with _file_lock(shared / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # leftovers of a build that failed
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def zero2_world2_run(shared_dir):
    """The uninterrupted 2-rank ZeRO-2 fp32 run of test_checkpoint_resume._train_args (8 steps, a checkpoint
    every 2), trained once per session (one xdist worker trains, another waits on the lock). Read as the
    reference by test_checkpoint_resume.py (stage 2) and test_checkpoint_crash.py. Readers only add to it:
    resuming from its step-2 checkpoint on another world size writes the universal conversion beside it."""
    from tests.e2e.test_checkpoint_resume import _train_args
    from tests.e2e.test_train_cli import run_cli

    return shared_build(
        shared_dir,
        "zero2_fp32_world2_8steps",
        lambda d: run_cli(_train_args(d.parent, d.name, "zero2_fp32", 2), world=2),
    )


@pytest.fixture(scope="session")
def tiny_const_lr_run(shared_dir):
    """A 3-step tiny run at a constant lr 2e-3 (after a 2-step warm-up) with a checkpoint at every step, trained
    once per session; test_faults.py resumes copies of it with another --lr (applied; or 1e6: diverges)."""
    from tests.e2e.test_faults import CONST_LR_ARGS
    from tests.e2e.test_train_cli import run_cli

    return shared_build(shared_dir, "tiny_const_lr_3steps", lambda d: run_cli(CONST_LR_ARGS(d.parent, d.name)))
