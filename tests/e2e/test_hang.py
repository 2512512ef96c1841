"""A rank that hangs (issue 58): rank 1 of a real 2-rank CPU training is SIGSTOPped after its first checkpoint.
The ranks run as two plain processes that meet over env:// (as in test_rank_lost.py: no launcher that would
end the survivor first), with a 4 s step floor, so the survivor's watchdog ends it within the bound it
printed, a few seconds after the stop rather than after the 30-minute process-group timeout: one line naming
rank 1, the last step and --resume latest, exit code 2, exit_status.json "hung", the latest checkpoint's
files byte for byte as they were."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import PY, ROOT, env

pytestmark = [pytest.mark.dist]

FLOOR_S = 4  # --step-timeout; the collective timeout (60 s) stays out of the way: the watchdog ends it


def _files(tag_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(tag_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in tag_dir.rglob("*")
            if p.is_file()}  # fmt: skip


def _lines(stream, into: list[str], seen: threading.Event, ready) -> None:
    for line in stream:
        into.append(line.rstrip("\n"))
        if ready(into):
            seen.set()


def _armed_and_saved(lines: list[str]) -> bool:
    """The hang bounds are armed (their line) and a checkpoint completed after it: latest exists (an asynchronous
    save's "checkpoint complete:" line, at a step boundary after its background write)."""
    armed = [i for i, ln in enumerate(lines) if ln.startswith("dsclip: hang bounds")]
    return bool(armed) and any(ln.startswith("checkpoint complete:") for ln in lines[armed[0] :])


def test_a_stopped_rank_ends_the_job_within_the_bound_with_one_line_and_latest_untouched(tmp_path):
    e = env()
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    args = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "hang", "--epochs", "50",
            "--max-steps", "1000", "--save-every-n-steps", "3", "--save-frequency", "0",
            "--step-timeout", str(FLOOR_S), "--collective-timeout", "60"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [PY, "-m", "dsclip", *args],
            cwd=ROOT,
            env={**e, "RANK": str(r), "LOCAL_RANK": str(r)},
            text=True,
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
        )  # fmt: skip
        for r in (0, 1)
    ]
    out: list[str] = []
    err: list[str] = []
    saved = threading.Event()
    readers = [
        threading.Thread(target=_lines, args=(procs[0].stdout, out, saved, _armed_and_saved), daemon=True),
        threading.Thread(target=_lines, args=(procs[0].stderr, err, threading.Event(), lambda _: False), daemon=True),
    ]
    for t in readers:
        t.start()
    ckpts = tmp_path / "hang" / "checkpoints"
    try:
        assert saved.wait(300), "\n".join(out[-20:] + err[-20:])
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        latest = (ckpts / "latest").read_text().strip()
        before = _files(ckpts / latest)
        rc = procs[0].wait(timeout=120)
        waited = time.monotonic() - stopped_at
        for t in readers:
            t.join(timeout=10)
        assert rc == 2, "\n".join(out[-20:] + err[-20:])
        lines = [ln for ln in err if ln.startswith("dsclip train: error:")]
        assert len(lines) == 1 and "Traceback" not in "\n".join(err), "\n".join(err[-30:])
        line = lines[0]
        steps = [int(m.group(1)) for ln in out if (m := re.match(r"step (\d+)/", ln))]
        # in a step, or in a save that the stopped rank never joined (its shards would never be written)
        during = (
            f"step {steps[-1] + 1} has run",
            f"save of checkpoint step_{steps[-1]:09d} has run",
            "completion of checkpoint step_",  # an asynchronous save's collective completion, at a step boundary
        )
        assert any(f"rank 0: hung: {d}" in line for d in during), line
        assert "stuck: rank 1 (no sign of life" in line and f"last step done: {steps[-1]};" in line, line
        assert f"latest names {ckpts / latest}, untouched" in line, line
        resume = shlex.join(["dsclip", *args, "--resume", "latest"])
        assert line.endswith(f"continue with --resume latest: {resume}"), line
        # within the bound it printed: the limit in force, plus a poll and the store's answer
        limit = float(re.search(r"= (\d+) s", line).group(1))
        assert FLOOR_S <= limit and waited < limit + 8, (waited, line)
        # nothing was saved after the stop: latest and its files are as they were
        assert (ckpts / "latest").read_text().strip() == latest and _files(ckpts / latest) == before
        status = json.loads((tmp_path / "hang" / "exit_status.json").read_text())
        assert status["stop"] == "hung" and status["exit_code"] == 2 and status["step"] == steps[-1], status
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()
