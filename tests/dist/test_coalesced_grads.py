"""The plan's gradient line against the bytes a rank really holds: rank 0 of a fake world-4 job
(bench/coalesced_grads.py: torch's fake process group, the gradient cache's coalesced block, bf16), measured
at the block's exit before its one reduction, under ZeRO-2 and ZeRO-3. One child process for the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsclip.plan import memory as M

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4


@pytest.fixture(scope="module")
def measured():
    cmd = [sys.executable, str(ROOT / "bench" / "coalesced_grads.py"), "--model", "demo", "--world", str(WORLD)]
    cmd += ["--zero", "2", "3", "--micro", "1", "--accum", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln.split("|")[1:-1] for ln in out.stdout.splitlines() if ln.startswith("| demo |")]
    return {int(r[2]): (int(r[4].replace(",", "")), int(r[5].replace(",", ""))) for r in rows}


@pytest.mark.parametrize("zero", [2, 3])
def test_plan_counts_the_whole_grad_a_rank_holds(measured, zero):
    grads, params = measured[zero]
    assert grads == M.whole_grad_bytes(params, "bf16")  # the whole 16-bit gradient, not a 1/N partition
    ds_partitions = M.model_state_bytes(params, WORLD, zero, "bf16")["grads"]
    assert grads > ds_partitions  # what DeepSpeed's own accounting (6 B x P / N) would have counted
    planned = M.gradient_cache_grad_bytes(ds_partitions, params, WORLD, zero, "bf16", offloaded=False)
    assert planned >= grads  # the plan counts at least what is held
