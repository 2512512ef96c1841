"""DeepSpeed's CPU shared-memory all-reduce workspace, unlinked from /dev/shm once every rank has mapped it.

Part of the process group's life cycle, not a patch: it changes no DeepSpeed code, it depends only on the
segment's internal name (csrc/cpu/comm/shm.cpp). Where a DeepSpeed names the
segment differently the file is not found and nothing happens: the leak stays, nothing breaks.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from dsclip.dist import initialized

SHM_WORKSPACE = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def release_shm_workspace() -> bool:
    """Unlink this rank's DeepSpeed CPU shared-memory all-reduce workspace from /dev/shm (keeping it mapped).

    Why: on a CPU accelerator DeepSpeed (0.19) creates a ~69 MB POSIX shm segment per rank when its
    comm backend starts (csrc/cpu/comm/shm.cpp, named from MASTER_ADDR/MASTER_PORT/rank) and never
    unlinks it, so every run leaves RAM-backed files behind until the machine fills up. Its
    initialisation returns only after the rank has opened every peer's segment, so once all ranks
    are past it (the barrier) the names are no longer needed; the mappings stay valid until exit.
    Safe to call more than once and where the segment does not exist (GPU runs). Collective when
    the world has more than one rank: call it on every rank. Returns True if a segment was removed.
    """

    if not initialized():
        return False
    path = SHM_WORKSPACE.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=dist.get_rank(),
    )
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        dist.barrier()  # every peer has mapped our segment
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
