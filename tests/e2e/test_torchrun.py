"""docs/clusters.md's torchrun command, as an OpenCLIP user pastes it (with --logs), on 2 CPU processes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import PY, ROOT, env


def documented_torchrun() -> list[str]:
    """The launcher part (up to and including `train`) of the torchrun command in docs/clusters.md."""
    section = (ROOT / "docs" / "clusters.md").read_text().split("## torchrun", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[0] == "torchrun" and "--logs" in argv, argv
    return argv[: argv.index("train") + 1]


def test_documented_torchrun_command_trains_with_logs(tmp_path):
    launcher = documented_torchrun()
    launcher[launcher.index("--nproc_per_node") + 1] = "2"
    torchrun = str(Path(PY).parent / "torchrun")
    cmd = [torchrun, "--master_port", str(free_port()), *launcher[1:], "--config", "tiny", "--logs", str(tmp_path),
           "--name", "tr", "--max-steps", "2", "--save-frequency", "0"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "| world 2 |" in p.stdout, p.stdout[-3000:]
    steps = [json.loads(ln) for ln in (tmp_path / "tr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
