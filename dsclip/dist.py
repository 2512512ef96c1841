"""Rank and world size of this process, for code that also runs without a process group.

The one place that asks "is torch.distributed initialised?": every package (the pure ones
included: losses, eval) reads the rank through here, so a single-process call (tests, tools,
``dsclip eval`` without a launcher) behaves as rank 0 of a world of 1.
"""

from __future__ import annotations

import sys


def initialized() -> bool:
    # Without torch loaded there is no process group: the run config's parser (``dsclip train --help``) and
    # the light commands ask this too, and must not import torch to learn it (issue #33).
    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _dist():
    import torch.distributed as dist  # only reached once initialized(): torch is loaded

    return dist


def rank_world(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if initialized():
        dist = _dist()
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if initialized():
        _dist().barrier()


def from_rank0(value):
    """Rank 0's ``value`` on every rank (a picklable object; collective when a process group exists)."""
    if not initialized() or _dist().get_world_size() == 1:
        return value
    dist = _dist()
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks(value) -> list:
    """Every rank's ``value`` (picklable), in rank order, on every rank. Collective when a process group exists."""
    if not initialized() or _dist().get_world_size() == 1:
        return [value]
    dist = _dist()
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
