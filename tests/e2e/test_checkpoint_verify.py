"""Verified checkpoints through the CLI (issue 32), in the order a cluster job meets the faults: a save
runs out of disk (one line, ``latest`` kept), then the latest checkpoint is damaged on disk (bytes flipped
in its optimizer shard): ``dsclip convert`` refuses it and never writes over an output without --force,
and the requeued job resumes from the newest checkpoint that verifies, saying which one it skipped and why.
The single-process checks of each kind of damage are in tests/unit/test_checkpoint.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsclip.cli import main as cli_main
from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import DEEPSPEED, PY, ROOT, assert_one_error_line, env, losses, run_cli

SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _args(tmp_path, *extra):
    return ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "run", "--max-steps", "3",
            "--save-every-n-steps", "1", "--save-frequency", "0", *extra]  # fmt: skip


def _disk_full_at(step: int) -> dict[str, str]:
    e = env()  # tests/e2e/patches/sitecustomize.py makes that save's first torch.save fail with ENOSPC
    e["PYTHONPATH"] = str(Path(__file__).parent / "patches") + os.pathsep + e["PYTHONPATH"]
    e["DSCLIP_FIXTURE_DISK_FULL"] = str(step)
    return e


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for at in (len(data) // 4, len(data) // 2, 3 * len(data) // 4):  # 3 x 64 bytes, as in the issue
        data[at : at + 64] = bytes(b ^ 0xFF for b in data[at : at + 64])
    path.write_bytes(bytes(data))


def _convert_error(capsys, args) -> str:
    assert cli_main(["convert", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsclip convert: error:"), err
    assert "error: dsclip convert:" not in err[0], err  # the command named once (issue 52)
    return err[0]


def test_disk_full_then_damaged_latest_resumes_from_newest_that_verifies(tmp_path, capsys):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    cmd = [PY, "-m", "dsclip", *_args(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=_disk_full_at(3), capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert_one_error_line(p.stderr, f"disk full while saving checkpoint to {ckpts / '.partial.step_000000003'}")
    assert "latest still names step_000000002" in p.stderr
    assert (ckpts / "latest").read_text() == "step_000000002"
    assert not list(ckpts.glob(".partial.*"))  # its space is free for the next attempt
    ref = losses(run)
    assert sorted(ref) == [1, 2, 3]  # step 3 was logged before its save failed

    shard = ckpts / "step_000000002" / SHARD
    _flip(shard)
    out = tmp_path / "export"
    err = _convert_error(capsys, [str(run), "-o", str(out)])
    assert f"{SHARD} is corrupt: crc32" in err and "--tag (step_000000001)" in err
    assert not out.exists()
    assert cli_main(["convert", str(run), "--tag", "step_000000001", "-o", str(out)]) == 0
    capsys.readouterr()  # zero_to_fp32's progress lines
    err = _convert_error(capsys, [str(run), "--tag", "step_000000001", "-o", str(out)])
    assert f"output {out} already exists" in err and "--force" in err
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert cli_main(["convert", str(run), "--tag", "step_000000001", "-o", str(out), "--force"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != before

    # the requeued job, resuming through DeepSpeed's own pointer file as an OpenCLIP user writes it
    p = run_cli(_args(tmp_path, "--resume", str(ckpts / "latest")))
    skipped = [line for line in p.stdout.splitlines() if "skipped" in line]
    assert len(skipped) == 1, p.stdout[-3000:]
    assert f"checkpoint {ckpts / 'step_000000002'} skipped: {SHARD} is corrupt: crc32" in skipped[0]
    assert f"resumed from {ckpts / 'step_000000001'} at step 1" in p.stdout
    resumed = losses(run)  # the resumed run's lines come last: its steps 2 and 3
    for step in (2, 3):
        assert resumed[step] == pytest.approx(ref[step], abs=1e-5), (step, resumed[step], ref[step])


@pytest.mark.dist
def test_disk_full_on_one_rank_stops_every_rank_in_one_line(tmp_path):
    """Rank 1's shard meets the full disk while rank 0's writes succeed: both ranks stop at the same point
    with the same line (no rank left waiting in a barrier for the process group timeout), nothing half-written
    is kept and ``latest`` stays on the last complete checkpoint."""
    ckpts = tmp_path / "run" / "checkpoints"
    args = _args(tmp_path, "--max-steps", "2", "--batch-size", "8", "--deepspeed-config", "ds_configs/zero2_fp32.json")
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsclip", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=_disk_full_at("2@1"), capture_output=True, text=True, timeout=600)
    assert p.returncode != 0, p.stderr[-3000:]
    said = f"dsclip train: error: disk full while saving checkpoint to {ckpts / '.partial.step_000000002'} (latest "
    assert p.stderr.count(said + "still names step_000000001)") == 2, p.stderr[-3000:]  # both ranks (their lines
    assert "Traceback" not in p.stderr  # may run together: the launcher merges the ranks' streams)
    assert (ckpts / "latest").read_text() == "step_000000001"
    assert not list(ckpts.glob(".partial.*"))
