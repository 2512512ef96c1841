"""The ranks of a host divide its cores between them (dsclip/engine/world/cores.py share_cores) by comparing
their affinity masks over a real gloo group: ranks on one host with overlapping masks share, a rank bound
to its own cores or on another host does not, and an explicit OMP_NUM_THREADS on one rank neither changes
its threads nor hangs the others (every rank still takes part in the exchange)."""

from __future__ import annotations

import pytest

from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]

# rank -> (host, cpus): ranks 0 and 1 share host a's cpus 0-7; rank 2 is bound to 8-11 on host a; rank 3
# has the same cpus 0-7 but on host b
LAYOUT = {0: ("a", range(8)), 1: ("a", range(8)), 2: ("a", range(8, 12)), 3: ("b", range(8))}


def _share(rank, world_size, explicit_rank):
    import torch

    from dsclip.engine.world import cores
    from dsclip.engine.world.discovery import WorldInfo

    host, cpus = LAYOUT[rank]
    cores.host_identity = lambda: host
    cores.cpu_affinity = lambda: list(cpus)
    torch.get_num_threads = lambda: 32  # torch's default on a 32-core host
    env = {"OMP_NUM_THREADS": "5"} if rank == explicit_rank else {}
    info = WorldInfo(rank, rank, world_size, world_size, "127.0.0.1", 0, "env")
    return cores.share_cores(info, env=env), env.get("OMP_NUM_THREADS")


@pytest.mark.parametrize("explicit_rank", [None, 1])
def test_ranks_divide_the_cores_they_share_on_their_host(explicit_rank):
    got = run_world(_share, 4, explicit_rank)
    expect = {0: 4, 1: 4, 2: 4, 3: 8}  # 8 cpus / 2 ranks; 4 own cpus; 8 own cpus on host b
    sharing = {0: 2, 1: 2, 2: 1, 3: 1}
    for rank, (line, exported) in enumerate(got):
        if rank == explicit_rank:
            assert line == "threads 32 (OMP_NUM_THREADS)" and exported == "5", line
            continue
        ranks = {2: "2 local ranks", 1: "1 local rank"}[sharing[rank]]
        assert line == f"threads {expect[rank]} ({len(LAYOUT[rank][1])} cpus / {ranks}, OMP_NUM_THREADS unset)"
        assert exported == str(expect[rank])
