"""One rank of a world-N job in this process: torch's fake process group under DeepSpeed.

torch ships a process group whose collectives return at once and move no data
(``torch.testing._internal.distributed.fake_pg``, backend ``"fake"``; torchtitan's memory estimator uses
it). Everything else a rank does is that of world N: DeepSpeed's partition and bucket sizes, the
optimizer's 1/N shard, the hooks and the host work of every step. Gathered shards are stale (nothing
arrives), so losses are meaningless: callers keep tensors finite and say so.

Only one thing differs from a real rank's start: DeepSpeed's CPU shared-memory all-reduce op would wait
in ``initialize`` for N - 1 peer processes that never come, so it is kept out as at one process
(``shm_op_for_world(1)``; DeepSpeed then calls torch.distributed's all-reduce, i.e. the fake group's).

One fake world per process: DeepSpeed keeps its process groups in module globals (deepspeed.utils.groups)
that a second ``init`` in the same process would find stale. Rehearse each configuration in its own process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

# what DeepSpeed and dsclip read to learn the world; set for the rehearsal's length, restored after
_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


class FakeWorldError(RuntimeError):
    """The fake process group cannot stand in here (already initialised, or torch lacks it)."""


@contextlib.contextmanager
def fake_world(world_size: int, gpus_per_node: int = 8, rank: int = 0) -> Iterator[None]:
    """Run the body as rank ``rank`` of a ``world_size`` job: the default process group is torch's fake
    group and DeepSpeed's communication backend is started on it. Destroyed, and the environment
    restored, on exit."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise FakeWorldError(f"rank {rank} of a world of {world_size}: need world >= 1 and 0 <= rank < world")
    if dist.is_initialized():
        raise FakeWorldError("a process group already exists in this process; the rehearsal needs its own")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # a torch built without it
        raise FakeWorldError(f"this torch has no fake process group ({exc}); torch >= 2.1 ships it") from exc
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    local = min(gpus_per_node, world_size)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank % local),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local),
        LOCAL_SIZE=str(local),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # never opened: the fake store is in-process
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        import deepspeed

        from dsclip.engine.shm_op import shm_op_for_world

        with shm_op_for_world(1):  # one process: no shm op, whose initialize waits for N - 1 peers
            deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_deepspeed_backend()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forget_deepspeed_backend() -> None:
    # deepspeed.comm keeps its backend in a module global; a later init in this process must start afresh
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and hasattr(comm, "cdb"):
        comm.cdb = None
