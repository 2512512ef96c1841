"""The last line of defence behind the run's own closing (tests/e2e/test_exit.py): a signal-safe loader whose
owner forgot to close it is shut down at interpreter exit, before multiprocessing's exit handler would join its
SIGTERM-ignoring workers forever, and the process says which loader was left open."""

from __future__ import annotations

import subprocess
import sys
import textwrap

LEFT_OPEN = textwrap.dedent(
    """
    import torch
    from dsclip.data.loader import leftover_workers, signal_safe_loader

    class Cycle:  # reachable only through a reference cycle: garbage collection would not reach it before exit
        pass

    c = Cycle()
    c.self = c
    c.loader = signal_safe_loader(torch.arange(8), batch_size=2, num_workers=1, persistent_workers=True)
    next(iter(c.loader))
    print("open:", leftover_workers(), flush=True)
    """
)


def test_a_loader_left_open_does_not_hang_the_exit():
    p = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "open: 1" in p.stdout, p.stderr[-2000:]
    assert "1 data loader(s) still had workers at exit" in p.stderr, p.stderr[-2000:]
