"""Shared-memory slots among the ranks of one host: each rank writes its own, every rank reads all.

Why: on CPU, ZeRO-1/2's two per-step collectives over the whole model (the gradient reduction and the
weight all-gather) were DeepSpeed's shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``),
an all-reduce even where each rank needs one partition of the sum (the reduction) or where all but one
partition of each summand are zeros (the gather): every rank copied the whole buffer into the shared
segment and the whole result back, summed, and busy-waited for the peers (a waiting rank burns its
core). With the gradients written straight into a slot every rank can read, a reduce-scatter is one
barrier plus each rank reading its own partition of every slot, and an all-gather is one barrier plus
each rank reading the others' partitions: a third of the memory traffic, and the wait is gloo's
(the thread sleeps). dsclip/engine/local_flush.py builds the flush and the gather on these slots.

A slot is a file in /dev/shm (tmpfs) that every rank maps and that is unlinked as soon as every rank has
mapped it, so nothing outlives the run (a crash included); its pages are reserved up front
(``posix_fallocate``), so a full /dev/shm is a clear fallback at start, not a SIGBUS mid-run.
"""

from __future__ import annotations

import errno
import os
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


def _slot_path(directory: str, token: str, rank: int) -> str:
    return os.path.join(directory, f"dsclip-slots-{os.getuid()}-{token}-{rank}")


def _reserve(path: str, nbytes: int) -> bool:
    """Create the file and reserve its pages; False where the directory cannot hold it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError as e:  # ENOSPC: /dev/shm too small (a container's 64 MB default); others: no tmpfs
        if e.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG):
            raise
        return False
    finally:
        os.close(fd)


def open_host_slots(numel: int, dtype: torch.dtype, group=None, directory: str = SHM_DIR) -> list[torch.Tensor] | None:
    """One zero-filled 1-D tensor of ``numel`` elements per rank of ``group`` (rank order), all in memory
    every rank of the group maps. Collective over the group.

    Returns None on every rank when any rank cannot reserve its slot (no /dev/shm, or too little room) or
    does not see every peer's (ranks on different hosts): the caller keeps its process-group path. Rank r
    writes only ``slots[r]``; a reader needs a barrier (or any collective) after the writer's last write,
    and a writer one after the readers' last read.
    """
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    own = _slot_path(directory, token[0], rank)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    ok = torch.tensor([1 if os.path.isdir(directory) and _reserve(own, nbytes) else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank's file exists (or one failed)
    if ok.item():
        # Every peer's file must be here: a rank on another host (a launcher's LOCAL_SIZE that does not
        # describe the job) has its file in that host's /dev/shm, and mapping the name here would create an
        # empty file nobody writes, a silent wrong sum. The token is rank 0's uuid, so a file with this name
        # on this host can only be a peer's.
        ok.fill_(int(all(os.path.exists(_slot_path(directory, token[0], r)) for r in range(world))))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    try:
        slots = None
        if ok.item():
            slots = [
                torch.from_file(_slot_path(directory, token[0], r), shared=True, size=numel, dtype=dtype)
                for r in range(world)
            ]
        dist.barrier(group=group)  # every rank has mapped every slot: the names can go
    finally:
        if os.path.exists(own):
            os.unlink(own)
    dist.barrier(group=group)  # every name is gone when any rank returns
    return slots
