"""A rank that dies (issue 52): rank 1 of 2 is SIGKILLed while writing its shards of step 4's checkpoint
(tests/e2e/patches/sitecustomize.py). The ranks run as two plain processes that meet over env:// (as torchrun
starts them, without a launcher that would kill the survivor first), so what rank 0 says is deterministic:
one dsclip line naming the rank, the step, the save under way, latest and --resume latest; exit non-zero."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import PY, ROOT, env

pytestmark = [pytest.mark.dist]


def test_survivor_says_which_rank_died_mid_save_in_one_line(tmp_path):
    e = env()
    e.update(
        PYTHONPATH=str(Path(__file__).parent / "patches") + os.pathsep + e["PYTHONPATH"],
        DSCLIP_FIXTURE_DIE_IN_SAVE="1@4",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    args = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "lost", "--max-steps", "6",
            "--save-every-n-steps", "2", "--save-frequency", "0"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [PY, "-m", "dsclip", *args],
            cwd=ROOT,
            env={**e, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert procs[1].returncode == -9  # the fixture's SIGKILL
    _, err = outs[0]
    assert procs[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err and "[rank0]" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("dsclip train: error:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    ckpts = tmp_path / "lost" / "checkpoints"
    assert "rank 1 stopped in the save of checkpoint step_000000004" in line and "after step 4" in line, line
    assert f"latest names {ckpts / 'step_000000002'}" in line and "--resume latest" in line, line
    assert "Connection reset by peer" in line or "Connection closed by peer" in line, line
    assert (ckpts / "latest").read_text().strip() == "step_000000002"  # the data is safe
