"""launch/deepspeed_hostfile.sh without a cluster: a stand-in `deepspeed` first on PATH records the
arguments and environment the script hands the real launcher (the boundary the script owns).
The real launches run in tests/e2e/test_launch.py on the test cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "deepspeed_hostfile.sh"

FAKE = """#!/usr/bin/env python3
import json, os, sys
status = open("/proc/self/status").read()
mask = lambda key: int(next(l for l in status.splitlines() if l.startswith(key)).split()[1], 16)
env_file = os.environ.get("DS_ENV_FILE")
json.dump({
    "argv": sys.argv[1:],
    "node_gpus": os.environ.get("DSCLIP_NODE_GPUS"),
    "ignored": mask("SigIgn:"),
    "blocked": mask("SigBlk:"),
    "supervisor": os.environ.get("DSCLIP_SUPERVISOR"),
    "ppid": os.getppid(),
    "parent": open(f"/proc/{os.getppid()}/cmdline").read().split("\\0"),
    "env_file": open(env_file).read() if env_file else None,
}, open(os.environ["FAKE_OUT"], "w"))
"""


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(FAKE)
    (bin_dir / "deepspeed").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=2\nnode2 slots=1\n")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("DSCLIP_", "TORCH_NCCL_", "NCCL_", "NUM_GPUS"))}
    env = dict(
        keep,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        VENV=str(tmp_path / "novenv"),
        HOSTFILE=str(hostfile),
        MASTER_PORT="23456",
        FAKE_OUT=str(tmp_path / "out.json"),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def run(*args, **extra):
        r = subprocess.run(
            [str(SCRIPT), *args], env={**env, **extra}, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else None
        return r, out

    return run


def split(argv):
    i = argv.index("--module")
    return argv[:i], argv[i + 2 :]  # launcher options, dsclip's (after `--module dsclip`)


def test_launcher_options_via_separator_and_knob(fake):
    r, out = fake("--include", "node1:0@node2:0", "--", "--epochs", "3", DS_LAUNCHER_ARGS="--bind_cores_to_rank")
    assert r.returncode == 0, r.stderr
    launcher, dsclip = split(out["argv"])
    assert launcher[-3:] == ["--bind_cores_to_rank", "--include", "node1:0@node2:0"]
    assert "--master_addr" in launcher and launcher[launcher.index("--master_addr") + 1] == "node1"
    assert dsclip[0] == "train" and dsclip[-2:] == ["--epochs", "3"] and "--include" not in dsclip


def test_without_separator_every_argument_goes_to_dsclip(fake):
    r, out = fake("--epochs", "3", "--batch-size", "8")
    assert r.returncode == 0, r.stderr
    launcher, dsclip = split(out["argv"])
    assert dsclip[-4:] == ["--epochs", "3", "--batch-size", "8"] and "--epochs" not in launcher


def test_recipe_none_passes_no_config_and_a_stable_name(fake, tmp_path):
    # what `dsclip plan --launcher hostfile` prints for a model without a recipe: dsclip train's defaults
    r, out = fake("--model", "ViT-B-16", RECIPE="none")
    assert r.returncode == 0, r.stderr
    _, dsclip = split(out["argv"])
    assert "--config" not in dsclip and dsclip[-2:] == ["--model", "ViT-B-16"]
    assert dsclip[dsclip.index("--name") + 1] == "run"  # not "none"; the same on a restart
    r, out = fake()  # the default stays the demo recipe
    _, dsclip = split(out["argv"])
    assert dsclip[dsclip.index("--config") + 1] == "dsclip/recipes/demo.yaml" and "demo" in dsclip


def test_num_gpus_above_a_hosts_slots_is_one_line_before_launching(fake):
    r, out = fake(NUM_GPUS="2")
    assert r.returncode == 2 and out is None
    line = r.stderr.strip()
    assert "\n" not in line and "NUM_GPUS=2" in line and "node2 has slots=1" in line and "at most" in line
    r, out = fake(NUM_GPUS="1")  # fewer ranks than slots is allowed
    assert r.returncode == 0 and "--num_gpus" in out["argv"]


def test_pdsh_mode_forwards_torch_nccl_settings(fake):
    r, out = fake(TORCH_NCCL_ASYNC_ERROR_HANDLING="1", NCCL_SOCKET_IFNAME="ib0")
    assert r.returncode == 0, r.stderr
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in out["env_file"].splitlines()
    # NCCL_* reach remote ranks through DeepSpeed itself (its forwarded prefixes), not the env file
    # the pdsh form runs under the supervisor too (it signals the remote ranks over pdsh), signals blocked
    assert "--launcher" in out["argv"] and out["parent"][1:5] == ["-m", "dsclip", "launch", "--"], out["parent"]
    assert all(out["blocked"] & (1 << (sig - 1)) for sig in (signal.SIGUSR1, signal.SIGTERM))
    assert "DSCLIP_SUPERVISOR" not in out["env_file"]  # written before the supervisor: remote ranks do not watch it


def test_per_node_mode_keeps_slurm_gpus_and_shields_the_launcher_from_signals(fake):
    r, out = fake(NODE_RANK="1", CUDA_VISIBLE_DEVICES="6,7")
    assert r.returncode == 0, r.stderr
    assert "--no_ssh" in out["argv"] and out["node_gpus"] == "6,7"
    # under the supervisor (dsclip launch), which forwards them to the ranks and waits for them: the launcher
    # has them blocked (launch.py's own SIGTERM handler would replace SIG_IGN and end the ranks early)
    assert out["parent"][1:5] == ["-m", "dsclip", "launch", "--"], out["parent"]
    assert out["supervisor"].split(":")[0] == str(out["ppid"])  # the ranks watch it (their stop if it dies)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        assert out["blocked"] & (1 << (sig - 1)), sig
