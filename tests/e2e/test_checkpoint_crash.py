"""SIGKILL a 2-rank `dsclip train` (launcher and ranks, like a node dying) mid-training and in the middle
of a checkpoint write; `--resume latest` must pick a complete checkpoint and finish with exactly the
weights of an uninterrupted run. `--keep-last 1` must not have pruned the old checkpoint before the
new one was complete."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import DEEPSPEED, ROOT, env, losses, run_cli

pytestmark = [pytest.mark.dist]
STEPS = 8  # the shared reference run's length (test_checkpoint_resume.zero2_world2_run)


def _args(tmp_path, name, *extra):
    return [
        "train",
        "--config",
        "tiny",
        "--logs",
        str(tmp_path),
        "--name",
        name,
        "--deepspeed-config",
        "ds_configs/zero2_fp32.json",
        "--max-steps",
        str(STEPS),
        "--save-every-n-steps",
        "2",
        "--batch-size",
        "8",
        "--lr-scheduler",
        "cosine",
        "--warmup",
        "2",
        "--save-frequency",
        "0",
        "--keep-last",
        "1",
        *extra,
    ]


def _start(args, extra_env=None):
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsclip", *args]
    e = env()
    e.update(extra_env or {})
    return subprocess.Popen(
        cmd, cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )  # its own process group: kill launcher + ranks at once


def _slow_save(*, seconds: float, step: int) -> dict[str, str]:
    """Environment that makes rank 0 pause between the shard writes and COMPLETE of one save
    (tests/e2e/patches/sitecustomize.py patches the checkpointer from outside)."""
    fixture = str(Path(__file__).parent / "patches")
    return {
        "PYTHONPATH": fixture + os.pathsep + env()["PYTHONPATH"],
        "DSCLIP_FIXTURE_SLOW_SAVE": f"{seconds}@{step}",
    }


def _kill_when(proc, condition, timeout=300):
    t0 = time.time()
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"training ended (rc {proc.returncode}) before the kill point")
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("kill point not reached in time")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from dsclip.checkpoint.convert import lazy_fp32_state_dict

    return {k: t.load().clone() for k, t in lazy_fp32_state_dict(run / "checkpoints", f"step_{STEPS:09d}").items()}


def _latest(run: Path) -> str | None:
    p = run / "checkpoints" / "latest"
    return p.read_text().strip() if p.exists() else None


def test_sigkill_mid_training_and_during_save_then_resume_latest(tmp_path, zero2_world2_run):
    # The uninterrupted reference: the same arguments but --keep-last, which changes no number.
    ref = _final_weights(zero2_world2_run)
    ref_curve = losses(zero2_world2_run)

    # 1. killed between checkpoints: after step 3 was logged and step 2's checkpoint completed (its files are
    # written in the background: latest moves at the step boundary after every rank's write finished)
    run = tmp_path / "mid"
    metrics = run / "metrics.jsonl"
    proc = _start(_args(tmp_path, "mid"))
    _kill_when(
        proc, lambda: metrics.exists() and '"step": 3,' in metrics.read_text() and _latest(run) == "step_000000002"
    )
    assert _latest(run) == "step_000000002"
    p = run_cli(_args(tmp_path, "mid", "--resume", "latest"), world=2)
    assert "resumed from" in p.stdout and "step_000000002" in p.stdout
    _assert_same(ref, _final_weights(run))
    assert [t.name for t in (run / "checkpoints").glob("step_*")] == [f"step_{STEPS:09d}"]  # --keep-last 1

    # 2. killed while step 4 is being saved: every rank's shards are written, COMPLETE is not
    run = tmp_path / "save"
    partial = run / "checkpoints" / ".partial.step_000000004"
    proc = _start(_args(tmp_path, "save"), _slow_save(seconds=60, step=4))
    _kill_when(
        proc,
        lambda: len(list(partial.glob("*optim_states.pt"))) == 2 and (partial / "mp_rank_00_model_states.pt").exists(),
    )
    ckpts = run / "checkpoints"
    assert _latest(run) == "step_000000002"
    assert (ckpts / "step_000000002" / "COMPLETE").exists()  # not pruned: the new one never completed
    assert not (ckpts / "step_000000004").exists()
    p = run_cli(_args(tmp_path, "save", "--resume", "latest"), world=2)
    assert "step_000000002" in p.stdout
    _assert_same(ref, _final_weights(run))
    resumed = losses(run)  # the killed run's lines come first; the resumed run re-logs steps 3..6
    for step in range(3, STEPS + 1):
        assert resumed[step] == pytest.approx(ref_curve[step], abs=1e-5)
    assert not partial.exists()  # the next save removed the leftover


def _assert_same(ref, got):
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
