"""Faults a cluster job meets (issue 32), each as a user meets it through the CLI: demo model, few steps."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess

import pytest

from tests.e2e.test_train_cli import PY, ROOT, assert_one_error_line, env, run_cli


def _tiny(tmp_path, name, *extra):
    return ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", name, "--max-steps", "2",
            "--save-frequency", "0", *extra]  # fmt: skip


# another run's rank 0, as dsclip's lock looks from outside: an flock on RUN/.lock recording host and PID
HOLD = """import fcntl, os, socket, sys
os.makedirs(sys.argv[1], exist_ok=True)
f = open(os.path.join(sys.argv[1], ".lock"), "w")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
f.write(f"host {socket.gethostname()} pid {os.getpid()}"); f.flush()
print("held", flush=True); sys.stdin.read()"""


def test_second_writer_refused_and_dead_holder_is_free(tmp_path):
    """A run folder held by a live run refuses a second one (one line naming host and PID, nothing written);
    once the holder is gone (its lock released by the kernel) the same command runs."""
    run_dir = tmp_path / "twice"
    holder = subprocess.Popen(
        [PY, "-c", HOLD, str(run_dir)],
        cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_cli(_tiny(tmp_path, "twice"), check=False)
        assert p.returncode == 2, p.stderr[-3000:]
        assert_one_error_line(p.stderr, f"pid {holder.pid}")
        assert socket.gethostname() in p.stderr
        assert not (run_dir / "run_config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.communicate("")  # the holder exits: the kernel drops its lock, the stale record stays
    assert f"pid {holder.pid}" in (run_dir / ".lock").read_text()
    run_cli(_tiny(tmp_path, "twice"))
    assert (run_dir / "run_config.yaml").exists()
    record = (run_dir / ".lock").read_text()
    assert record.startswith(f"host {socket.gethostname()} pid ") and f"pid {holder.pid}" not in record


def CONST_LR_ARGS(logs, name, *extra):  # noqa: N802 (a constant-like recipe, shared with conftest)
    return ["train", "--config", "tiny", "--logs", str(logs), "--name", name, "--max-steps", "3",
            "--save-every-n-steps", "1", "--save-frequency", "0", "--lr-scheduler", "const", *extra]  # fmt: skip


def _copy_run(run, tmp_path, name):
    shutil.copytree(run, tmp_path / name)  # its lock's holder is gone: the copy is free to resume
    return tmp_path / name


def _logged(run_dir, key):
    """step -> ``key`` of the last record of that step in metrics.jsonl (a resumed run's lines come last)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            out[rec["step"]] = rec[key]
    return out


def _max_abs_weight(ckpt_dir, tag):
    from dsclip.checkpoint.convert import lazy_fp32_state_dict

    weights = {k: t.load().detach() for k, t in lazy_fp32_state_dict(ckpt_dir, tag).items()}
    assert all(bool(w.isfinite().all()) for w in weights.values())
    return max(float(w.abs().max()) for w in weights.values()), float(weights["logit_scale"])


def test_resume_with_new_lr_and_wd_applies_them_in_one_line(tmp_path, tiny_const_lr_run):
    """--lr/--wd changed on resume: one line names old and new values, and the next steps use the new lr (the
    checkpoint's schedule used to win while run_config.yaml recorded the new value)."""
    run = _copy_run(tiny_const_lr_run, tmp_path, "newlr")
    assert _logged(run, "lr")[2] == pytest.approx(2e-3)  # the constant phase of the checkpoint's run
    p = run_cli(CONST_LR_ARGS(tmp_path, "newlr", "--resume", str(run / "checkpoints" / "step_000000002"),
                              "--lr", "1e-3", "--wd", "0.05"))  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("resume:")]
    assert lines == ["resume: --lr 0.001 (checkpoint had 0.002), --wd 0.05 (checkpoint had 0.1): applied from step 3"]
    assert _logged(run, "lr")[3] == pytest.approx(1e-3)  # this run's --lr, really used
    state = json.loads((run / "checkpoints" / "step_000000003" / "dsclip_state.json").read_text())
    assert state["optim"]["lr"] == 1e-3 and state["optim"]["wd"] == 0.05  # what the next resume compares with


def test_diverged_run_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_const_lr_run):
    """--lr 1e6 (issue 32): step 4's loss is finite but its update blows the weights up, and every later step is
    NaN and skipped. The run stops after --max-skipped-steps such steps with one line naming the last good
    checkpoint (exit 2), saves nothing from the NaN steps, keeps that checkpoint despite --keep-last 1, marks
    the blown-up step-4 tag DIVERGED and points latest back at step 3, which a new resume takes."""
    run = _copy_run(tiny_const_lr_run, tmp_path, "diverge")
    ckpts = run / "checkpoints"
    args = CONST_LR_ARGS(tmp_path, "diverge", "--max-steps", "8", "--resume", "latest", "--keep-last", "1")
    p = run_cli([*args, "--lr", "1e6", "--max-skipped-steps", "2"], check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    good = ckpts / "step_000000003"
    assert_one_error_line(p.stderr, f"last good checkpoint: {good} ")
    assert "training diverged: 2 consecutive steps" in p.stderr and "steps 5-6" in p.stderr
    assert "training diverged" in (run / "out.log").read_text()  # the run's log says it too
    assert math.isnan(_logged(run, "loss_last")[5]) and 7 not in _logged(run, "loss_last")  # stopped at 6
    assert (ckpts / "latest").read_text().strip() == "step_000000003"
    # step 4 was saved (its loss was finite) and holds the blown-up weights; steps 5-6 were never saved
    assert sorted(t.name for t in ckpts.glob("step_*")) == ["step_000000003", "step_000000004"]
    assert (ckpts / "step_000000004" / "DIVERGED").is_file()
    good_max, good_scale = _max_abs_weight(ckpts, "step_000000003")
    blown_max, _ = _max_abs_weight(ckpts, "step_000000004")
    assert good_max < 20 and abs(good_scale) < 10 and blown_max > 1e3, (good_max, good_scale, blown_max)
    # a requeued `--resume latest` continues from the good tag (here with a sane lr, to the end)
    p = run_cli([*args, "--lr", "2e-3", "--max-steps", "4"])
    assert f"resumed from {good} at step 3" in p.stdout
