"""``--remote-sync URL``: the run folder copied to ``URL/NAME/`` in the background (OpenCLIP's flags).

OpenCLIP syncs ``logs/NAME`` every ``--remote-sync-frequency`` seconds from a background process (``aws s3
sync``, or fsspec), and ``--resume latest`` then looks for the newest checkpoint remotely. dsclip does the
same with fsspec as the client for both protocols (s3 through s3fs), with what its checkpoints need:

- only complete tags are uploaded (never ``.partial.*`` or ``.trash.*`` folders, never ``universal/``), and
  a tag's files go first, its ``MANIFEST.json`` and then ``COMPLETE`` last: a remote tag without ``COMPLETE``
  is an upload that did not finish and is never taken. ``checkpoints/latest`` follows once the tag it names
  is complete remotely; a re-saved tag loses its remote ``COMPLETE`` before its files are replaced.
- ``--keep-last N`` applies remotely: once a tag is complete there, remote tags older than it are deleted
  (``COMPLETE`` first) unless they are among the newest N remote ones or the local folder still keeps them
  (the confirmed-good tag the Checkpointer holds back while a newer one is unconfirmed).
- the logs (everything in the run folder outside ``checkpoints/`` but the run lock) are uploaded when their
  size or modification time changed.
- one thread on rank 0 (the run folder is one shared folder: every rank writes its shards and ``--log-local``
  files into it), woken every ``--remote-sync-frequency`` seconds and when a tag becomes complete
  (:meth:`RemoteSync.tag_complete`, called by the Checkpointer). Training never waits for it. A remote that
  fails (unreachable, refusing a write) is one line, retried at the next tick; every call has bounded
  timeouts; recovering is one line too. :meth:`RemoteSync.close` (every end of a run) runs the last sync,
  waits for it and says in one line whether it completed.
- ``--resume latest`` with no complete local checkpoint downloads the newest complete remote tag (the one the
  remote ``latest`` names first) into ``RUN/checkpoints`` and verifies it against its manifest before it is
  used (dsclip.checkpoint.remote_resume); a tag that fails is one line and the previous one is tried.
  The remote folder itself (client, timeouts) is dsclip.checkpoint.remote_store.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dsclip.checkpoint.ds_checkpoint import complete_tags
from dsclip.checkpoint.layout import COMPLETE, DIVERGED, LATEST, MANIFEST
from dsclip.checkpoint.remote_store import CKPT, Store, reason_of
from dsclip.config_base import ConfigError, opt
from dsclip.console import say

UNUSED = ("universal",)  # made on demand from a tag's shards by a resume on another world size: not synced
LOCAL_ONLY = (".lock",)  # the run lock (dsclip.checkpoint.run_lock): this host's, meaningless elsewhere
FINAL_SYNC_LIMIT_S = 3600  # the run's end waits this long at most for the last sync (a big last checkpoint)


@dataclass
class RemoteSyncArgs:
    """Run config section ``remote``: OpenCLIP's --remote-sync flags (dsclip.checkpoint.remote_sync)."""

    remote_sync: str | None = opt(
        None,
        "Copy the run folder (logs and complete checkpoints) to URL/NAME/ in the background, e.g. "
        "s3://bucket/runs; --resume latest without a local checkpoint takes the newest remote one "
        "(docs/checkpoints.md).",
    )
    remote_sync_frequency: int = opt(
        300, "Seconds between two syncs of the logs (a checkpoint is synced as soon as it is complete)."
    )
    remote_sync_protocol: str = opt(
        "s3", "s3 (s3:// URLs through s3fs) or fsspec (any fsspec URL; its package installed).", ("s3", "fsspec")
    )

    def check(self) -> None:
        if self.remote_sync_frequency <= 0:
            raise ConfigError(f"--remote-sync-frequency must be > 0 seconds, got {self.remote_sync_frequency}")
        url = self.remote_sync
        if url is None:
            return
        if self.remote_sync_protocol == "s3" and not url.startswith("s3://"):
            raise ConfigError(
                f"--remote-sync {url}: --remote-sync-protocol s3 takes an s3://bucket/path URL; "
                "use --remote-sync-protocol fsspec for other file systems"
            )
        if "://" not in url:
            raise ConfigError(f"--remote-sync {url}: not a URL (e.g. s3://bucket/runs, gs://bucket/runs, file:///path)")


class RemoteSync:
    """Rank 0's background sync of the run folder to a Store (see the module's docstring)."""

    def __init__(self, run_dir: Path, store: Store, *, frequency: float, keep_last: int, say=say):
        self.run_dir, self.store = Path(run_dir), store
        self.frequency, self.keep_last, self._say = frequency, keep_last, say
        self._logs_sent: dict[str, tuple[int, int]] = {}  # rel path -> (size, mtime_ns) uploaded
        self._remote_tags: set[str] | None = None  # complete remote tags (listed once, then kept up to date)
        self._resaved: set[str] = set()  # tags completed again locally: uploaded again even if complete remotely
        self._markers_sent: set[str] = set()  # tags whose DIVERGED marker is remote
        self._latest_sent: str | None = None
        self._failing: str | None = None  # the reason of the last failure while failing
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.last_ok: bool | None = None  # the outcome of the last sync (None: none ran)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CKPT

    # -- the thread ---------------------------------------------------------------------------------------
    def start(self) -> RemoteSync:
        """The first sync right away, then one every ``frequency`` seconds (daemon: :meth:`close` ends it)."""
        self._thread = threading.Thread(target=self._loop, name="dsclip-remote-sync", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                closing = self._closing
            self.last_ok = self.sync_once()
            if closing:
                return
            self._wake.wait(self.frequency)
            self._wake.clear()

    def tag_complete(self, tag_dir: Path) -> None:
        """A tag just became complete locally (rank 0, the Checkpointer): upload it now, in the background."""
        with self._lock:
            self._resaved.add(Path(tag_dir).name)
        self._wake.set()

    def close(self, limit_s: float = FINAL_SYNC_LIMIT_S) -> bool:
        """The last sync (after the one under way), waited for; one line saying whether it completed. Returns
        whether it did."""
        started = time.perf_counter()
        if self._thread is None:  # never started (tests): sync here
            self.last_ok = self.sync_once()
        else:
            with self._lock:
                self._closing = True
            self._wake.set()
            self._thread.join(limit_s)
            if self._thread.is_alive():
                self.last_ok = False
                self._failing = self._failing or f"still running after {limit_s:.0f} s"
        seconds = time.perf_counter() - started
        if self.last_ok:
            self._say(f"dsclip: remote sync: {self.run_dir} synced to {self.store.url} (last sync {seconds:.1f} s)")
        else:
            self._say(
                f"dsclip: remote sync: the last sync to {self.store.url} did not complete ({self._failing}); "
                f"{self.run_dir} holds the whole run: copy it yourself, or let a --resume latest run sync it"
            )
        return bool(self.last_ok)

    # -- one sync -----------------------------------------------------------------------------------------
    def sync_once(self) -> bool:
        """Logs, then complete tags not yet remote (oldest first, pruning after each), then the markers and
        ``latest``. Any failure: one line (the first of a run of failures), False; retried at the next tick."""
        try:
            self._sync_logs()
            self._sync_checkpoints()
        except Exception as e:  # any remote failure: one line, training goes on, the next tick retries
            reason = reason_of(e)
            if self._failing is None:
                self._say(
                    f"dsclip: remote sync to {self.store.url} failed ({reason}); training goes on, retried every "
                    f"{self.frequency:g} s"
                )
            self._failing = reason
            return False
        if self._failing is not None:
            self._say(f"dsclip: remote sync to {self.store.url} works again")
            self._failing = None
        return True

    def _put_local(self, local: Path, rel: str) -> bool:
        """Upload ``local``; False when it vanished meanwhile (a pruned tag, a replaced temporary file)."""
        try:
            self.store.put(local, rel)
            return True
        except (FileNotFoundError, NotADirectoryError):
            if local.exists():
                raise  # the remote's "no such bucket", not a local file gone
            return False

    def _sync_logs(self) -> None:
        for root, dirs, names in os.walk(self.run_dir):
            here = Path(root)
            if here == self.run_dir:
                dirs[:] = [d for d in dirs if d != CKPT and not d.startswith(".")]
            for name in names:
                if name.startswith(".") or name in LOCAL_ONLY:  # temporary files of atomic writes, the lock
                    continue
                local = here / name
                rel = local.relative_to(self.run_dir).as_posix()
                try:
                    st = local.stat()
                except FileNotFoundError:
                    continue
                if self._logs_sent.get(rel) == (st.st_size, st.st_mtime_ns):
                    continue
                if self._put_local(local, rel):
                    self._logs_sent[rel] = (st.st_size, st.st_mtime_ns)

    def _local_complete(self) -> list[str]:
        return complete_tags(self.ckpt_dir)

    def _sync_checkpoints(self) -> None:
        if self._remote_tags is None:
            self._remote_tags = set(self.store.complete_tags())
        with self._lock:
            resaved, self._resaved = self._resaved, set()
        try:
            for tag in self._local_complete():
                if tag in self._remote_tags and tag not in resaved:
                    continue
                resaved.discard(tag)
                if self._upload_tag(tag):
                    self._prune_remote(newest=tag)
        finally:
            with self._lock:  # not reached (a failure): the next tick uploads them again
                self._resaved |= {t for t in resaved if t not in self._remote_tags}
        self._sync_markers()

    def _upload_tag(self, tag: str) -> bool:
        """A tag's files, then its manifest, then COMPLETE; False when the local tag vanished meanwhile."""
        tag_dir, remote = self.ckpt_dir / tag, f"{CKPT}/{tag}"
        self._remote_tags.discard(tag)
        self._markers_sent.discard(tag)
        self.store.rm(f"{remote}/{COMPLETE}")  # a re-saved tag stops being complete remotely before it changes
        files = [p for p in sorted(tag_dir.rglob("*")) if p.is_file()]
        rels = [p.relative_to(tag_dir).as_posix() for p in files]
        last = (MANIFEST, COMPLETE)
        order = [r for r in rels if r.split("/")[0] not in UNUSED and r not in last and r != DIVERGED]
        for rel in [*order, *[r for r in last if r in rels]]:
            if not self._put_local(tag_dir / rel, f"{remote}/{rel}"):
                self.store.rm(remote)  # pruned locally mid-upload: never complete remotely either
                return False
        if COMPLETE not in rels:
            return False
        self._remote_tags.add(tag)
        return True

    def _prune_remote(self, newest: str) -> None:
        """--keep-last remotely, once ``newest`` is complete there (see the module's docstring)."""
        if self.keep_last <= 0:
            return
        remote = sorted(self._remote_tags)
        keep = set(remote[-self.keep_last :]) | set(self._local_complete())
        for old in remote:
            if old < newest and old not in keep:
                self.store.rm(f"{CKPT}/{old}/{COMPLETE}")  # not complete any more before any file goes
                self.store.rm(f"{CKPT}/{old}")
                self._remote_tags.discard(old)

    def _sync_markers(self) -> None:
        """DIVERGED markers a later step put on tags, and ``latest`` once the tag it names is complete remotely."""
        for tag in self._local_complete():
            marker = self.ckpt_dir / tag / DIVERGED
            if tag in self._remote_tags and tag not in self._markers_sent and marker.is_file():
                if self._put_local(marker, f"{CKPT}/{tag}/{DIVERGED}"):
                    self._markers_sent.add(tag)
        pointer = self.ckpt_dir / LATEST
        named = pointer.read_text().strip() if pointer.is_file() else None
        if named == self._latest_sent or (named is not None and named not in self._remote_tags):
            return
        if named is None:
            self.store.rm(f"{CKPT}/{LATEST}")  # the run diverged before any good tag: no remote latest either
        else:
            self.store.write_text(f"{CKPT}/{LATEST}", named)
        self._latest_sent = named


def close(sync: RemoteSync | None) -> None:
    """The run's end, whatever ended it: the last sync waited for, one line (no-op without --remote-sync)."""
    if sync is not None:
        sync.close()
