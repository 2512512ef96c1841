"""`dsclip train --remote-sync` against a real S3-compatible server on localhost (SeaweedFS: tests/s3_server.py):
a 2-rank run syncs, its local folder is deleted, and `--resume latest` continues from the remote bit for bit;
a server stopped mid-run is one line, training goes on and the run's end says the last sync did not complete."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_checkpoint_resume import _train_args
from tests.e2e.test_train_cli import DEEPSPEED, PY, ROOT, env, losses

pytestmark = [pytest.mark.dist]


def _cmd(args: list[str], world: int) -> list[str]:
    if world == 1:
        return [PY, "-m", "dsclip", *args]
    return [DEEPSPEED, "--num_gpus", str(world), "--master_port", str(free_port()), "--module", "dsclip", *args]


def _train(args: list[str], server, world: int = 1) -> subprocess.CompletedProcess:
    p = subprocess.run(
        _cmd(args, world), cwd=ROOT, env={**env(), **server.env()}, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def _weights(tag_dir) -> dict[str, torch.Tensor]:
    return torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def test_two_rank_run_syncs_and_resumes_from_the_remote_bit_identically(tmp_path, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/runs"
    args = _train_args(tmp_path, "rs", "zero2_fp32", 2, "--max-steps", "4", "--remote-sync", url)
    first = _train(args, s3_server, world=2)  # checkpoints at steps 2 and 4
    run = tmp_path / "rs"
    assert f"synced to {url}/rs" in first.stdout and "did not complete" not in first.stdout
    fs, remote = s3_server.filesystem(), f"{s3_bucket}/runs/rs"
    tags = sorted(p.split("/")[-2] for p in fs.glob(f"{remote}/checkpoints/step_*/COMPLETE"))
    assert tags == ["step_000000002", "step_000000004"]
    assert fs.cat_file(f"{remote}/checkpoints/latest").decode() == "step_000000004"
    assert fs.cat_file(f"{remote}/metrics.jsonl") == (run / "metrics.jsonl").read_bytes()  # the logs, final
    assert not fs.glob(f"{remote}/checkpoints/.partial*") and not fs.exists(f"{remote}/.lock")
    reference, ref_weights = losses(run), _weights(run / "checkpoints/step_000000004")

    # the machine is gone with the run folder, and step 4's upload had not finished (no COMPLETE remotely,
    # though the remote latest names it): the resume downloads step 2, verifies it and trains steps 3-4 again
    shutil.rmtree(run)
    fs.rm(f"{remote}/checkpoints/step_000000004/COMPLETE")
    second = _train([*args, "--resume", "latest"], s3_server, world=2)
    assert f"downloaded {url}/rs/checkpoints/step_000000002" in second.stdout
    assert f"resumed from {run / 'checkpoints/step_000000002'} at step 2" in second.stdout
    resumed = losses(run)
    assert resumed == {3: reference[3], 4: reference[4]}  # bit for bit: the same floats
    weights = _weights(run / "checkpoints/step_000000004")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    # and synced again: step 4 complete remotely, the logs of this start
    assert fs.exists(f"{remote}/checkpoints/step_000000004/COMPLETE")
    assert fs.cat_file(f"{remote}/metrics.jsonl") == (run / "metrics.jsonl").read_bytes()


def test_server_stopped_mid_run_is_one_line_and_training_goes_on(tmp_path):
    """Its own server (the session's stays up for the other tests), stopped once the first step is done."""
    from tests.s3_server import start

    server = start(tmp_path / "weed")
    try:
        server.make_bucket(server.bucket)
        args = [
            "train", "--config", "tiny", "--logs", str(tmp_path / "logs"), "--name", "r", "--max-steps", "30",
            "--save-every-n-steps", "10", "--save-frequency", "0", "--remote-sync", f"s3://{server.bucket}",
            "--remote-sync-frequency", "1",
        ]  # fmt: skip
        with open(tmp_path / "stderr", "w") as err:
            p = subprocess.Popen(
                _cmd(args, 1), cwd=ROOT, env={**env(), **server.env()}, stdout=subprocess.PIPE, stderr=err, text=True
            )
            out = []
            for line in p.stdout:
                out.append(line)
                if line.startswith("step 1/30"):
                    server.stop()
            rc = p.wait(timeout=600)
    finally:
        server.stop()
    stdout, stderr = "".join(out), (tmp_path / "stderr").read_text()
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    failed = [line for line in out if "remote sync to" in line and "failed (" in line]
    assert len(failed) == 1 and "training goes on" in failed[0], stdout[-3000:]
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert sorted(losses(tmp_path / "logs/r")) == list(range(1, 31))  # every step trained
    assert (tmp_path / "logs/r/checkpoints/latest").read_text() == "step_000000030"
    last = [line for line in out if "remote sync:" in line][-1]
    assert "the last sync to" in last and "did not complete" in last, stdout[-3000:]
    status = json.loads((tmp_path / "logs/r/exit_status.json").read_text())
    assert status["exit_code"] == 0
