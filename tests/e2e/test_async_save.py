"""Asynchronous saves and data-only loads through the CLI (issues 65 and 66).

- An asynchronous save writes exactly the files a blocking one writes, and ``--resume latest`` from it continues
  bit-identically (ZeRO-2 and ZeRO-3, world 2; a constant LR, so a 2-step run and its resume to step 4 follow
  the 4-step run's schedule).
- SIGKILL while the background write runs (made slow by tests/e2e/patches/sitecustomize.py's
  DSCLIP_FIXTURE_SLOW_WRITE): ``latest`` stays on the previous complete tag, which the next start resumes, and
  that start removes the half-written ``.partial`` tag.
- A checkpoint whose pickle would run code (MANIFEST.json rewritten to match): ``dsclip convert`` and
  ``--resume latest`` run nothing and fail in one line.
A full disk during the background write: tests/e2e/test_checkpoint_verify.py (saves are asynchronous by default).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dsclip.checkpoint import manifest
from tests.e2e.test_checkpoint_crash import _kill_when, _latest, _start
from tests.e2e.test_train_cli import assert_one_error_line, env, losses, run_cli

pytestmark = [pytest.mark.dist]


def _args(logs, name, stage, steps, *extra):
    return ["train", "--config", "tiny", "--logs", str(logs), "--name", name,
            "--deepspeed-config", f"ds_configs/zero{stage}_fp32.json", "--max-steps", str(steps),
            "--save-every-n-steps", "2", "--save-frequency", "0", "--batch-size", "8", "--lr-scheduler", "const",
            "--warmup", "0", *extra]  # fmt: skip


def _assert_identical(a: Path, b: Path):
    """The fp32 master weights of two tags, consolidated (ZeRO-3's flat partitions end in padding that is never
    initialised, so raw shards of two processes differ there), bit for bit."""
    from dsclip.checkpoint.convert import lazy_fp32_state_dict

    ta, tb = (lazy_fp32_state_dict(t.parent, t.name) for t in (a, b))
    assert set(ta) == set(tb) and ta
    for k in ta:
        assert torch.equal(ta[k].load(), tb[k].load()), k


@pytest.mark.parametrize("stage", [2, 3])
def test_async_save_resumes_bit_identically_to_a_blocking_save(tmp_path, stage):
    run_cli(_args(tmp_path, "blocking", stage, 4, "--no-async-save"), world=2)
    run_cli(_args(tmp_path, "async", stage, 2), world=2)
    blocking, asynchronous = tmp_path / "blocking" / "checkpoints", tmp_path / "async" / "checkpoints"
    _assert_identical(blocking / "step_000000002", asynchronous / "step_000000002")  # the same state
    assert manifest.verify(asynchronous / "step_000000002").ok
    p = run_cli(_args(tmp_path, "async", stage, 4, "--resume", "latest"), world=2)
    assert "resumed from" in p.stdout and "step_000000002" in p.stdout
    assert "waiting for the background write of checkpoint step_000000004" in p.stdout  # the run's end waited
    _assert_identical(blocking / "step_000000004", asynchronous / "step_000000004")
    ref, got = losses(tmp_path / "blocking"), losses(tmp_path / "async")
    assert [got[s] for s in (3, 4)] == [ref[s] for s in (3, 4)]  # exactly: the Adam moments resumed equal too


def test_sigkill_during_the_background_write_keeps_latest_and_the_next_start_removes_the_partial(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    partial = ckpts / ".partial.step_000000004"
    fixture = str(Path(__file__).parent / "patches")
    slow = {"PYTHONPATH": fixture + os.pathsep + env()["PYTHONPATH"], "DSCLIP_FIXTURE_SLOW_WRITE": "120@4"}
    proc = _start(_args(tmp_path, "run", 2, 6), slow)
    # the step-4 save has started writing (its folder exists) and step 5 trained past it: the write is in flight
    metrics = tmp_path / "run" / "metrics.jsonl"
    _kill_when(proc, lambda: partial.is_dir() and metrics.exists() and '"step": 5,' in metrics.read_text())
    assert _latest(tmp_path / "run") == "step_000000002" and (ckpts / "step_000000002" / "COMPLETE").exists()
    assert not (ckpts / "step_000000004").exists() and partial.is_dir()
    p = run_cli(_args(tmp_path, "run", 2, 4, "--resume", "latest"), world=2)
    assert "resumed from" in p.stdout and "step_000000002" in p.stdout
    assert not partial.exists() and _latest(tmp_path / "run") == "step_000000004"


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # loading this creates the file


def test_a_checkpoint_that_would_run_code_runs_nothing_in_convert_or_resume(tmp_path, tiny_const_lr_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_const_lr_run, run)
    tag = run / "checkpoints" / "step_000000003"
    target, marker = tag / "mp_rank_00_model_states.pt", tmp_path / "ran"
    torch.save({"module": _RunsCode(marker)}, target)  # a stranger's file, its manifest entry made to match
    mf = json.loads((tag / "MANIFEST.json").read_text())
    mf["files"][target.name] = manifest.entry(target)
    (tag / "MANIFEST.json").write_text(json.dumps(mf))
    assert manifest.verify(tag).ok

    said = "needs the global io.open, which is not among the classes dsclip loads from checkpoints"
    p = run_cli(["convert", str(run), "-o", str(tmp_path / "out")], check=False)
    assert p.returncode == 2 and not marker.exists(), p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("dsclip convert: error:")]
    assert len(errors) == 1 and said in errors[0] and str(target) in errors[0] and "Traceback" not in p.stderr

    from tests.e2e.test_faults import CONST_LR_ARGS

    p = run_cli(CONST_LR_ARGS(tmp_path, "run", "--resume", "latest", "--max-steps", "4"), check=False)
    assert p.returncode == 2 and not marker.exists(), p.stderr[-2000:]
    assert_one_error_line(p.stderr, said)
