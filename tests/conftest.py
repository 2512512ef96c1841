"""Test-session hygiene shared by all suites."""

from __future__ import annotations

import glob
import os
import sys

import pytest

SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"

# Every subprocess (deepspeed launcher, ranks, the launch scripts, which activate the venv) must find
# the venv's ninja first: DeepSpeed JIT-builds its CPU shm op with whichever `ninja` is on PATH, and
# two ninja binaries alternating on one TORCH_EXTENSIONS_DIR rebuild it from scratch each time
# (minutes on 2 cores; longer inside a SLURM task bound to one core).
_venv_bin = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _venv_bin:
    os.environ["PATH"] = _venv_bin + os.pathsep + os.environ.get("PATH", "")


def _mapped_files() -> set[str]:
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return mapped


@pytest.fixture(autouse=True)
def _remove_leaked_deepspeed_shm():
    """DeepSpeed's CPU shared-memory all-reduce (0.19) never unlinks its ~69 MB segment per rank, and
    /dev/shm is RAM: hundreds of multi-rank runs in one suite would exhaust the machine. After each
    test, delete the segments no live process maps any more (a running job's stay untouched)."""
    yield
    leaked = glob.glob(SHM_PATTERN)
    if not leaked:
        return
    in_use = _mapped_files()
    for path in leaked:
        if path not in in_use:
            try:
                os.unlink(path)
            except OSError:
                pass
