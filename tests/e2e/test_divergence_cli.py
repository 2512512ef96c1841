"""A divergence that stays finite (issue 52), through the CLI on copies of the shared 3-step tiny run (every
case in ONE process, run_cli_cases): --lr 1e6 / 1e3 under a long warm-up drive the logit scale to 0 while the
loss stays finite (ln 16, chance); the run used to end with exit 0 and keep the blown-up weights as good."""

from __future__ import annotations

import json
import shutil

from tests.e2e.test_faults import CONST_LR_ARGS
from tests.e2e.test_train_cli import run_cli_cases

BLOW_UP = [
    "--max-steps",
    "8",
    "--resume",
    "latest",
    "--keep-last",
    "1",
    "--lr-scheduler",
    "cosine",
    "--warmup",
    "10000",
]


def _error_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("dsclip train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_finite_divergence_ends_nonzero_keeps_the_good_tag_and_a_blown_up_tag_is_not_resumed(
    tmp_path, tiny_const_lr_run
):
    for name in ("lr1e6", "lr1e3", "old"):
        shutil.copytree(tiny_const_lr_run, tmp_path / name)
    old = tmp_path / "old" / "checkpoints"
    cases = {
        "lr1e6": CONST_LR_ARGS(tmp_path, "lr1e6", *BLOW_UP, "--lr", "1e6"),
        "lr1e3": CONST_LR_ARGS(tmp_path, "lr1e3", *BLOW_UP, "--lr", "1e3"),
        # a run whose LAST step blows the weights up (no later step sees it): judged by its final weights
        "old_blowup": CONST_LR_ARGS(tmp_path, "old", *BLOW_UP[2:], "--max-steps", "4", "--lr", "1e6"),
        "bad_k": CONST_LR_ARGS(tmp_path, "badk", "--divergence-k", "-1"),
    }
    out = run_cli_cases(cases)
    for name in ("lr1e6", "lr1e3"):
        rc, err = out[name]
        ckpts = tmp_path / name / "checkpoints"
        assert rc == 2, (name, err[-3000:])
        line = _error_line(err)
        assert "training diverged: the run ended after" in line, line
        assert f"last good checkpoint: {ckpts / 'step_000000003'} " in line, line
        first_bad = int(line.split("(step")[1].split("-")[0].strip("s :"))
        assert first_bad <= 6, line  # fires within a few steps of the blow-up (resumed at step 3)
        assert (ckpts / "latest").read_text().strip() == "step_000000003"
        assert (ckpts / "step_000000003").is_dir()  # --keep-last 1 never pruned the newest confirmed tag
        unconfirmed = [p for p in ckpts.glob("step_*") if p.name > "step_000000003"]
        assert all((p / "DIVERGED").is_file() for p in unconfirmed), unconfirmed
        status = json.loads((tmp_path / name / "exit_status.json").read_text())
        assert (
            status["exit_code"] == 2
            and status["stop"] == "diverged"
            and status["checkpoint"].endswith("step_000000003")
        )
    rc, err = out["bad_k"]
    assert rc == 2 and "--divergence-k must be > 0, got -1.0" in _error_line(err)
    rc, err = out["old_blowup"]
    assert rc == 2 and "(step 4: loss" in _error_line(err) and "the weights after it: its logit scale" in err
    assert (old / "latest").read_text().strip() == "step_000000003" and (old / "step_000000003").is_dir()
    # what today's main left behind after such a run: latest on the blown-up tag, unmarked; a requeue refuses it
    (old / "step_000000004" / "DIVERGED").unlink()
    (old / "latest").write_text("step_000000004")
    out = run_cli_cases(
        {
            "old_requeue": CONST_LR_ARGS(tmp_path, "old", "--max-steps", "10", "--resume", "latest"),
            "old_again": CONST_LR_ARGS(tmp_path, "old", "--max-steps", "4", "--resume", "latest"),
        }
    )
    rc, err = out["old_requeue"]
    assert rc == 2
    line = _error_line(err)
    assert f"checkpoint {old / 'step_000000004'} holds diverged weights" in line and "logit scale" in line, line
    assert f"resume from {old / 'step_000000003'} (--resume latest now takes it)" in line, line
    assert out["old_again"][0] == 0, out["old_again"][1][-3000:]  # --resume latest now falls back past it
    log = (old.parent / "out.log").read_text()
    resumed = [ln.split("resumed from ", 1)[1] for ln in log.splitlines() if "resumed from " in ln]
    assert resumed[-2:] == [f"{old / 'step_000000004'} at step 4", f"{old / 'step_000000003'} at step 3"], resumed
