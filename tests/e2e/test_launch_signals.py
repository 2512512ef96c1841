"""Stop signals through the DeepSpeed launcher on one machine, started as docs/clusters.md says
(its "one machine" command, 2 CPU ranks, the tiny recipe).

Whatever is signalled, the ranks finish the step, save, and exit 143, and the process that was started
(the one a scheduler watches) exits only after every rank has. What was measured without the
supervisor (plain `deepspeed`): SIGTERM to the launcher alone returned 143 at once while the ranks
never got the signal and trained on, orphaned; SIGTERM to the process group returned 143 ~19 s
before the ranks finished saving. "After" is asserted by order, not by time: when the started process
has exited, no process of the run is left, and every checkpoint file is older than that exit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import DEEPSPEED, PY, ROOT, env

pytestmark = [pytest.mark.dist]

LONG = ["--max-steps", "100000", "--epochs", "1000", "--save-frequency", "0"]


def documented_one_machine() -> list[str]:
    """The launcher part (up to and including `train`) of docs/clusters.md's "one machine" command."""
    lines = (ROOT / "docs" / "clusters.md").read_text().splitlines()
    row = next(ln for ln in lines if ln.startswith("| one machine |"))
    argv = shlex.split(row.split("`")[1])
    return argv[: argv.index("train") + 1]


def launch_command(train_args: list[str]) -> list[str]:
    """The documented command with this venv's executables, 2 ranks and a free port."""
    argv = documented_one_machine()
    argv[argv.index("--num_gpus") + 1] = "2"
    out = []
    for i, a in enumerate(argv):
        if a == "dsclip" and i == 0:  # the command, not `--module dsclip`
            out += [PY, "-m", "dsclip"]
        elif a == "deepspeed":
            out += [DEEPSPEED, "--master_port", str(free_port())]
        else:
            out.append(a)
    return out + train_args[1:]  # train_args starts with "train", which the documented part ends with


def tagged_pids(tag: str) -> list[int]:
    """Every live process of the run: the test started it with DSCLIP_SIGNAL_TEST=tag in its environment."""
    mark = f"DSCLIP_SIGNAL_TEST={tag}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if mark in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                pids.append(int(d))
        except (OSError, IndexError):
            continue
    return pids


class Launch:
    def __init__(self, tmp_path: Path, name: str, extra: list[str]):
        self.tag = uuid.uuid4().hex
        self.run_dir = tmp_path / name
        self.log = tmp_path / f"{name}.log"
        self.cmd = launch_command(["train", "--config", "tiny", "--logs", str(tmp_path), "--name", name, *extra])
        self.env = dict(env(), DSCLIP_SIGNAL_TEST=self.tag)
        self.proc: subprocess.Popen | None = None

    def start(self, **kw) -> subprocess.Popen:
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT, **kw)
        return self.proc

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_steps(self, n: int = 2, timeout: float = 240) -> None:
        """Until n steps are in metrics.jsonl: training is under way, so a signal lands mid-run."""
        deadline = time.monotonic() + timeout
        metrics = self.run_dir / "metrics.jsonl"
        while True:
            assert self.proc.poll() is None, f"the launch ended before training ran:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {n} training steps after {timeout} s:\n{self.output()[-4000:]}"
            if metrics.exists() and sum('"loss"' in ln for ln in metrics.read_text().splitlines()) >= n:
                return
            time.sleep(0.3)

    def wait_exit(self, timeout: float = 120) -> tuple[int, float, list[int]]:
        """(exit code, the time it exited, the run's processes still alive at that moment)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s after the signal:\n{self.output()[-4000:]}")
        return rc, time.time(), tagged_pids(self.tag)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def launches():
    made: list[Launch] = []
    yield made
    for launch in made:
        launch.cleanup()


def saved_step(launch: Launch, rc: int, exited_at: float, alive: list[int]) -> int:
    """The checks common to every signal: exit 143 after the ranks, a checkpoint saved before it."""
    out = launch.output()
    assert not alive, f"the launch exited ({rc}) while processes {alive} of the run still ran:\n{out[-4000:]}"
    assert rc == 143, out[-4000:]
    m = re.search(r"checkpoint saved at step (\d+); exiting with 143", out)
    assert m and int(m.group(1)) >= 2, out[-4000:]
    step = int(m.group(1))
    ckpt = launch.run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    assert tag == f"step_{step:09d}", tag
    files = [p for p in (ckpt / tag).iterdir()] + [ckpt / "latest"]
    assert {"MANIFEST.json", "COMPLETE"} <= {p.name for p in files}
    newest = max(p.stat().st_mtime for p in files)
    assert newest <= exited_at, f"checkpoint written {newest - exited_at:.2f} s after the launch exited"
    # what the batch scripts read when srun's own code cannot say it (launch/slurm/*.sbatch)
    status = json.loads((launch.run_dir / "exit_status.json").read_text())
    good = status.pop("goodput")  # the run's wall time by kind (issue 65): a stop's wind-down is its own kind
    assert status == {"exit_code": 143, "stop": "terminate", "step": step, "checkpoint": str(ckpt / tag)}, status
    assert good["seconds"]["stop"] > 0 and good["seconds"]["save"] > 0, good
    return step


def test_sigterm_to_the_launcher_alone_saves_on_every_rank_and_resumes(tmp_path, launches):
    run = Launch(tmp_path, "alone", LONG)
    launches.append(run)
    run.start()
    run.wait_for_steps()
    os.kill(run.proc.pid, signal.SIGTERM)  # the started process only, as `kill PID` or a process supervisor does
    step = saved_step(run, *run.wait_exit())
    # both ranks saved their shard of that step (ZeRO-2: one optimizer file per rank)
    shards = sorted(p.name for p in (run.run_dir / "checkpoints" / f"step_{step:09d}").glob("*optim_states.pt"))
    assert len(shards) == 2, shards

    resumed = Launch(tmp_path, "alone", ["--resume", "latest", "--max-steps", str(step + 1), "--save-frequency", "0"])
    launches.append(resumed)
    p = subprocess.run(resumed.cmd, cwd=ROOT, env=resumed.env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"at step {step}" in p.stdout and "resumed from" in p.stdout, p.stdout[-3000:]
    metrics = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(ln)["step"] for ln in metrics if '"loss"' in ln]
    assert logged[-1] == step + 1 and logged.count(step + 1) == 1, logged


def test_sigterm_to_the_process_group_ends_after_the_save(tmp_path, launches):
    # a data worker per rank: in the group too, and torch's workers die of SIGTERM (the rank then crashed unsaved)
    run = Launch(tmp_path, "group", [*LONG, "--workers", "1"])
    launches.append(run)
    run.start(start_new_session=True)  # its own group, so that the whole group can be signalled (not pytest)
    run.wait_for_steps()
    os.killpg(run.proc.pid, signal.SIGTERM)  # every process: launchers, ranks, data workers (Ctrl-\, a scheduler)
    saved_step(run, *run.wait_exit())


def test_torchrun_under_dsclip_launch_exits_with_the_ranks_code(tmp_path, launches):
    """torchrun's agent reports a rank that exits 143 as a failure: it SIGTERMs the other ranks and exits 1
    (measured, torch 2.14). Under `dsclip launch` the ranks record their own code (DSCLIP_LAUNCH_STATUS), so
    a SIGTERM to the supervisor still ends in 143 after the ranks saved: what a scheduler reads as "stopped"."""
    run = Launch(tmp_path, "torchrun", LONG)
    torchrun = str(Path(PY).parent / "torchrun")
    train = run.cmd[run.cmd.index("train") :]
    run.cmd = [PY, "-m", "dsclip", "launch", "--", torchrun, "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "dsclip", "--", *train]  # fmt: skip
    launches.append(run)
    run.start()
    run.wait_for_steps()
    os.kill(run.proc.pid, signal.SIGTERM)  # the supervisor, as a scheduler signals the process it started
    saved_step(run, *run.wait_exit())
    assert "the launcher exited 1, the ranks 143 after saving; exit 143" in run.output(), run.output()[-3000:]
