"""One writer per run folder: rank 0 holds an exclusive ``flock`` on ``RUN/.lock`` for the run's life.

A job submitted twice, or a requeue while the old ranks still run, would otherwise interleave two
runs' checkpoints and metrics in one folder. ``flock`` is released by the kernel when the holding
process dies (however it dies), so a requeued job whose predecessor is dead simply takes the lock:
there is no stale-lock cleanup to get wrong. The file records who holds it, for the error message.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from dsclip.config_base import ConfigError

LOCK_FILE = ".lock"
_held: dict[Path, object] = {}  # open lock files of this process: closing one would release its lock


def acquire(run_dir: Path) -> None:
    """Take ``run_dir``'s lock (idempotent in one process); a held lock is a one-line ConfigError naming
    the host and PID that hold it."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK_FILE, "a+")  # no truncation before we hold it: the holder's record stays readable
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            f"run folder {run_dir} is in use by {holder} (lock {run_dir / LOCK_FILE}); wait for that run to end, "
            "stop it, or choose another --name"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    f.flush()
    _held[run_dir] = f


def release_all() -> None:
    while _held:
        _held.popitem()[1].close()  # closing the descriptor releases the flock
