"""The batch scripts' requeue decision (launch/slurm/train.sbatch, train_per_node.sbatch) without a cluster:
a stand-in srun plays what the ranks did (writes dsclip's RUN/exit_status.json, exits with srun's code) and
a stand-in scontrol records the requeue.

The case that made this necessary (CI, test_launch.py's requeue test under train_per_node.sbatch): after
SIGUSR1 node 1's task exited 85, srun's --kill-on-bad-exit SIGTERMed node 2's task while it was exiting
85 too, and srun reported 143, which the script took for a scancel: no requeue. The real sequence runs on
the test cluster in tests/e2e/test_launch.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_SRUN = """#!/usr/bin/env python3
import json, os, signal, sys, time
# the real srun passes the batch shell's signals on to the tasks; the stand-in's "tasks" are this script
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("FAKE_WAIT"):  # until the test has signalled the batch shell
    deadline = time.monotonic() + 20
    while not os.path.exists(os.environ["FAKE_WAIT"]) and time.monotonic() < deadline:
        time.sleep(0.05)
status = os.environ.get("FAKE_STATUS")
if status:
    run = os.path.join(os.environ["LOGS"], os.environ["NAME"])
    os.makedirs(run, exist_ok=True)
    open(os.path.join(run, "exit_status.json"), "w").write(status)
sys.exit(int(os.environ["FAKE_RC"]))
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && echo node1
[ "$1" = "requeue" ] && echo "$2" >> "$FAKE_REQUEUED"
exit 0
"""


def status(code: int, stop: str) -> str:
    return json.dumps({"exit_code": code, "stop": stop, "step": 4, "checkpoint": "x/checkpoints/step_000000004"})


@pytest.fixture
def batch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DSCLIP_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "dsclip",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "DSCLIP_REPO": str(REPO),
        "LOGS": str(tmp_path / "logs"),
        "NAME": "run",
        "GPUS_PER_NODE": "1",
        "FAKE_REQUEUED": str(tmp_path / "requeued"),
    }

    def run(script: str, *, rc: int, exit_status: str | None = None, signal_first: int | None = None):
        """Run the script; with signal_first the batch shell gets that signal while srun runs (as SLURM's
        --signal=B:USR1 or a scancel sends it), and srun ends only after it."""
        e = dict(env, FAKE_RC=str(rc), FAKE_STATUS=exit_status or "")
        (tmp_path / "signalled").unlink(missing_ok=True)
        if signal_first is not None:
            e["FAKE_WAIT"] = str(tmp_path / "signalled")
        proc = subprocess.Popen(
            ["bash", str(REPO / "launch" / "slurm" / script)], env=e, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        if signal_first is not None:
            time.sleep(1.0)  # the trap is set before srun starts; give bash the time to get there
            proc.send_signal(signal_first)
            (tmp_path / "signalled").touch()
        out, _ = proc.communicate(timeout=60)
        requeued = (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []
        return proc.returncode, requeued, out

    return run


SCRIPTS = ["train.sbatch", "train_per_node.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_requeue_dsclip_asked_for_survives_srun_reporting_a_sibling_s_143(batch, script):
    rc, requeued, out = batch(script, rc=143, exit_status=status(85, "requeue"), signal_first=signal.SIGUSR1)
    assert requeued == ["4242"] and rc == 0, out
    assert "srun exited 143, but dsclip saved and asked for a requeue" in out, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_after_usr1_is_not_requeued(batch, script):
    # dsclip said 143 (a TERM reached the ranks): the job ends, whatever srun's code
    rc, requeued, out = batch(script, rc=143, exit_status=status(143, "terminate"), signal_first=signal.SIGUSR1)
    assert requeued == [] and rc == 143, out
    # and a TERM to the batch shell itself wins over an exit status that asked for a requeue
    rc, requeued, out = batch(script, rc=143, exit_status=status(85, "requeue"), signal_first=signal.SIGTERM)
    assert requeued == [] and rc == 143, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_exit_status_left_by_the_last_start_does_not_speak_for_this_one(batch, tmp_path, script):
    stale = tmp_path / "logs" / "run" / "exit_status.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(status(85, "requeue"))
    rc, requeued, out = batch(script, rc=1)  # this start crashed before dsclip wrote anything
    assert requeued == [] and rc == 1, out
    assert not stale.exists()
