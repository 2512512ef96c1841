"""dsclip as a user installs it: `pip wheel .`, the wheel in a fresh venv, `dsclip train` from an empty
directory with a shipped recipe name and a shipped DeepSpeed config name.

The heavy dependencies (torch, deepspeed, timm, ...) are made visible from the dev venv through a
`.pth` line instead of being reinstalled (minutes, and this machine's index serves them locally only).
A plain path in a `.pth` file does not process the `.pth` files inside it, so the dev venv's editable
dsclip (itself a `.pth` finder) stays invisible: dsclip can come only from the wheel, which the test
checks before training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_in_a_fresh_venv_trains_two_steps_from_an_empty_directory(tmp_path):
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the dev venv's setuptools builds it (no index needed); --no-deps: dsclip only
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("dsclip-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dsclip/ds_configs/zero3_bf16.json" in names and "dsclip/recipes/tiny.yaml" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    vpy = venv / "bin" / "python"
    subprocess.run(
        [str(vpy), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = subprocess.run(
        [str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "zz_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "empty"
    work.mkdir()
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(launch)}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    where = subprocess.run(
        [str(vpy), "-c", "import dsclip; print(dsclip.__file__)"],
        cwd=work,
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    where = where.stdout.strip()
    assert where.startswith(site), f"dsclip imported from {where}, not from the installed wheel in {site}"

    p = subprocess.run(
        [
            str(venv / "bin" / "dsclip"),
            "train",
            "--config",
            "tiny",
            "--deepspeed-config",
            "zero3_bf16",
            "--precision",
            "bf16",
            "--max-steps",
            "2",
            "--save-frequency",
            "0",
            "--logs",
            "runs",
            "--name",
            "installed",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = work / "runs" / "installed"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2]
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"] is True
    assert sorted(p.name for p in work.iterdir()) == ["runs"]  # nothing else written into the cwd
