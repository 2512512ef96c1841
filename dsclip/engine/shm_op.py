"""DeepSpeed's CPU shared-memory all-reduce op at the process group's start: not at one rank, and quietly.

Part of the process group's start (dsclip/engine/world/process_group.py, fake_world.py), not a patch of the seam: it
flips an entry of an internal DeepSpeed table for the duration of ``init_distributed`` and restores it.
DeepSpeed's TorchBackend builds (JIT-compiles
on first use) and loads ``deepspeed_shm_comm`` every time it starts, whatever the world size, and prints
"DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" on every rank. A one-rank run
never all-reduces across processes, so there :func:`shm_op_for_world` marks the op incompatible for the
duration of ``deepspeed.init_distributed`` (DeepSpeed then uses torch.distributed's own all-reduce, as
it does on GPUs); no build, no load, no line. With more ranks the op is used; only its line is dropped.

Where a DeepSpeed keeps no ``deepspeed.ops.__compatible_ops__`` table, nothing is changed there: the op
is built and loaded as before (slower first run, nothing breaks).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator

SHM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME
BUILT_LINE = "deepspeed_shm_comm_op built successfully"  # comm/torch.py's build_shm_op


@contextlib.contextmanager
def shm_op_for_world(world_size: int) -> Iterator[None]:
    """Wrap ``deepspeed.init_distributed``: at ``world_size == 1`` the shm op is neither built nor loaded;
    the "built successfully" line never reaches stdout (the other stdout lines are passed on)."""
    table = None
    if world_size == 1:
        import deepspeed.ops

        table = getattr(deepspeed.ops, "__compatible_ops__", None)
    saved = table.get(SHM_OP) if isinstance(table, dict) else None
    if isinstance(table, dict):
        table[SHM_OP] = False
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        if isinstance(table, dict):
            if saved is None:
                table.pop(SHM_OP, None)
            else:
                table[SHM_OP] = saved
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if BUILT_LINE not in line]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()
