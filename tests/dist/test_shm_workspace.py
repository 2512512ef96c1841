"""DeepSpeed's CPU shared-memory all-reduce segment must not outlive a dsclip run in /dev/shm."""

from __future__ import annotations

import os

import pytest

from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]


def _rank(rank, world):
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist

    from dsclip.engine.shm_workspace import SHM_WORKSPACE, release_shm_workspace

    deepspeed.init_distributed(dist_backend="gloo")
    path = SHM_WORKSPACE.format(
        uid=os.getuid(), addr=os.environ["MASTER_ADDR"], port=os.environ["MASTER_PORT"], rank=rank
    )
    existed = os.path.exists(path)
    removed = release_shm_workspace()
    dist.barrier()
    gone = not os.path.exists(path)
    # the shm all-reduce keeps working on its mapping after the name is gone
    t = torch.full((1000,), float(rank + 1))
    ds_comm.inference_all_reduce(t)
    return {"existed": existed, "removed": removed, "gone": gone, "sum": t[0].item(), "again": release_shm_workspace()}


def test_release_shm_workspace_unlinks_each_ranks_segment_and_keeps_all_reduce_working():
    res = run_world(_rank, 2)
    for r in res:
        assert r["existed"], "DeepSpeed no longer creates the segment: the release may be dropped"
        assert r["removed"] and r["gone"]
        assert r["sum"] == 3.0  # 1 + 2 over the shm kernel (or its gloo fallback)
        assert r["again"] is False  # idempotent
