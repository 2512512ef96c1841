"""dsclip/engine/host_memory.py: with glibc's thresholds fixed, memory a step frees is reused by the next
step instead of being faulted in again page by page. Measured in fresh processes (mallopt is process-wide
and cannot be undone): the same allocation pattern as a training step's gradients, a little larger each
round (what defeats glibc's own threshold adjustment), with and without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dsclip.engine.host_memory import keep_freed_memory

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, resource, sys, torch
from dsclip.engine.host_memory import keep_freed_memory
how = keep_freed_memory() if sys.argv[1] == "keep" else "untouched"
faults = []
for r in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    grads = [torch.ones((1 << 20) + r * 4096) for _ in range(64)]  # 64 x ~4 MB, written, then freed
    del grads
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps([how, faults]))
"""


def _probe(mode: str) -> tuple[str, list[int]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    how, faults = json.loads(p.stdout.strip().splitlines()[-1])
    return how, faults


def test_freed_memory_is_reused_by_the_next_round_instead_of_faulted_again():
    how, kept = _probe("keep")
    _, default = _probe("default")
    pages = 64 * 4 * 1024 * 1024 // 4096  # one round's memory in 4 KB pages
    assert how == "kept"
    assert min(default[2:]) > pages // 2, default  # glibc's defaults hand every round's pages back
    assert max(kept[2:]) < pages // 50, kept  # kept: only the few new pages of the slightly larger round


def test_a_users_malloc_settings_or_allocator_are_left_alone():
    assert keep_freed_memory(env={"MALLOC_TRIM_THRESHOLD_": "1048576"}) == "env"
    assert keep_freed_memory(env={"MALLOC_MMAP_THRESHOLD_": "65536"}) == "env"
    assert keep_freed_memory(env={"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == "preloaded"
