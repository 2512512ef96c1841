"""``--resume latest`` with --remote-sync: the newest complete remote checkpoint, downloaded and verified.

With no complete checkpoint in the local run folder, rank 0 downloads the remote tag the remote ``latest``
names (then the others, newest first) into ``RUN/checkpoints/.partial.remote.<tag>``, checks it against its
manifest (dsclip.checkpoint.manifest) and only then renames it into place with ``latest`` naming it; the
resume then goes on as from any local checkpoint (verified again, as every resume is). A tag that fails is
one line and the previous one is tried. A new run (no --resume) whose remote folder already holds
checkpoints is refused as a local one is (dsclip.checkpoint.run_folder).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from dsclip.checkpoint import manifest
from dsclip.checkpoint.ds_checkpoint import atomic_write, complete_tags
from dsclip.checkpoint.layout import COMPLETE, DIVERGED, LATEST, MANIFEST, PARTIAL_PREFIX
from dsclip.checkpoint.remote_store import CKPT, Store, open_store, reason_of
from dsclip.checkpoint.remote_sync import RemoteSyncArgs
from dsclip.config_base import ConfigError
from dsclip.console import say


def remote_candidates(store: Store) -> list[str]:
    """Complete remote tags in the order a resume tries them: the one the remote ``latest`` names, then the
    others newest first (as ds_checkpoint.candidate_tags locally)."""
    tags = store.complete_tags()[::-1]
    named = (store.read_text(f"{CKPT}/{LATEST}") or "").strip()
    if named in tags:
        tags.remove(named)
        tags.insert(0, named)
    return tags


def download_tag(store: Store, tag: str, ckpt_dir: Path) -> tuple[Path, int]:
    """``tag``'s remote files into ``ckpt_dir/.partial.remote.<tag>`` (a folder no resume reads; removed with
    the other leftovers if this is interrupted); returns that folder and the bytes downloaded."""
    part = ckpt_dir / f"{PARTIAL_PREFIX}remote.{tag}"
    shutil.rmtree(part, ignore_errors=True)
    files = store.files(f"{CKPT}/{tag}")
    for rel in sorted(files):
        dest = part / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        store.fs.get_file(store.path(f"{CKPT}/{tag}/{rel}"), str(dest))
    return part, sum(files.values())


def fetch_newest(store: Store, ckpt_dir: Path, *, say=say) -> str | None:
    """The newest complete remote tag that verifies against its manifest, downloaded into ``ckpt_dir`` (renamed
    into place only then) with ``latest`` naming it; each tag skipped is one line. None: none on the remote."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for tag in remote_candidates(store):
        where = f"{store.url}/{CKPT}/{tag}"
        if store.exists(f"{CKPT}/{tag}/{DIVERGED}"):
            say(f"dsclip: remote checkpoint {where} skipped: marked {DIVERGED}; trying the previous one")
            continue
        t0 = time.perf_counter()
        part, size = download_tag(store, tag, ckpt_dir)
        verdict = manifest.verify(part)
        if not verdict.ok or verdict.unverified:
            shutil.rmtree(part, ignore_errors=True)
            problem = verdict.problem or f"no {MANIFEST}"
            say(f"dsclip: remote checkpoint {where} skipped: {problem}; trying the previous one")
            continue
        target = ckpt_dir / tag
        if target.exists():
            shutil.rmtree(target)
        os.replace(part, target)
        atomic_write(ckpt_dir / LATEST, tag)
        say(f"dsclip: --resume latest: downloaded {where} ({size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s)")
        return tag
    return None


def prepare_run(args: RemoteSyncArgs, run_dir: Path, name: str, *, resume: str | None, overwrite: bool) -> Store | None:
    """Rank 0, before the resume is resolved: the run's Store (None without --remote-sync). ``--resume latest``
    with no complete local checkpoint: the newest remote one downloaded (:func:`fetch_newest`); a remote that
    cannot be read then is a ConfigError (starting from step 0 beside it would overwrite its ``latest``).
    Without --resume, a remote that holds this run's checkpoints is refused as a local one is
    (dsclip.checkpoint.run_folder), or with ``overwrite`` deleted."""
    if args.remote_sync is None:
        return None
    store = open_store(args.remote_sync, args.remote_sync_protocol, name)
    local = run_dir / CKPT
    try:
        if resume == "latest" and not complete_tags(local):
            fetch_newest(store, local)
        elif resume is None:
            _check_new_remote(store, overwrite)
    except ConfigError:
        raise
    except Exception as e:
        if resume is None:  # nothing to lose: the sync thread retries and says so
            say(f"dsclip: remote sync: cannot read {store.url} ({reason_of(e)}); training goes on, retried later")
            return store
        raise ConfigError(
            f"--resume latest: cannot read the remote checkpoints in {store.url} ({reason_of(e)}); fix the remote "
            "(endpoint, credentials) or drop --remote-sync to start from the local folder"
        ) from None
    return store


def _check_new_remote(store: Store, overwrite: bool) -> None:
    tags = store.complete_tags()
    if not tags:
        return
    if not overwrite:
        raise ConfigError(
            f"--remote-sync: {store.url} already holds checkpoints of a run named so (latest: {tags[-1]}); "
            "continue it with --resume latest, or choose another --name (--overwrite deletes it and starts over)"
        )
    say(f"dsclip: --overwrite: deleting the earlier run's checkpoints in {store.url} to start over")
    for tag in tags:
        store.rm(f"{CKPT}/{tag}/{COMPLETE}")
    store.rm(CKPT)
