"""A full disk (or an exceeded quota) during a checkpoint save, told apart from other write errors.

The save turns it into one line naming the path (:class:`DiskFullError`) instead of torch internals;
``dsclip.checkpoint.ds_checkpoint`` removes the half-written ``.partial`` folder and leaves ``latest``
where it was.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dsclip.config_base import ConfigError

LOW_SPACE = 16 << 20  # free bytes below which a failed write is taken for a full disk


class DiskFullError(ConfigError):
    """A save ran out of space (one line naming the path, like every user-fixable error)."""


def is_disk_full(exc: BaseException, where: Path) -> bool:
    """Whether ``exc`` comes from a full disk or an exceeded quota: ENOSPC/EDQUOT anywhere in its chain, or
    any OSError/RuntimeError while ``where``'s file system has (almost) no space left. The second test is
    needed because torch's zip writer reports a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos ...`` (after "basic_ios::clear: iostream error"), without an errno."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    if not isinstance(exc, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(where).free < LOW_SPACE
    except OSError:
        return False


class DiskFullGuard:
    """Around ``engine.save_checkpoint``: a full disk on this rank stops its writes but not the call, so the
    rank still reaches DeepSpeed's own barriers (a rank that raised there would leave the others waiting
    for the process group timeout); afterwards every rank learns whether any rank's disk was full.
    ``written``: the files this rank's checkpoint engine wrote (their checksums are taken on this rank)."""

    def __init__(self, engine, where: Path):
        self.engine, self.where, self.error = engine, where, None
        self.ce = getattr(engine, "checkpoint_engine", None)
        self.written: list[str] = []

    def _guarded(self, save, record: bool = False):
        def guarded(*args, **kwargs):
            if self.error is None:
                try:
                    save(*args, **kwargs)
                except Exception as e:
                    if not is_disk_full(e, self.where):
                        raise
                    self.error = e
                    return
                path = kwargs.get("path", args[1] if len(args) > 1 else None)  # CheckpointEngine.save(sd, path)
                if record and isinstance(path, (str, Path)):
                    self.written.append(str(path))

        return guarded

    def run(self, fn) -> BaseException | None:
        """Call ``fn`` (the save); the disk-full error of this rank, or None."""
        patched = self.ce is not None and hasattr(self.ce, "save")
        if patched:
            original = self.ce.save
            self.ce.save = self._guarded(original, record=True)
        try:
            self._guarded(fn)()  # also what DeepSpeed writes outside its checkpoint engine (rank 0's scripts)
        finally:
            if patched:
                self.ce.save = original
        return self.error
