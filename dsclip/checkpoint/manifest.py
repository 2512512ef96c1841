"""Checkpoint manifests: every file of a tag with its size and crc32, so a resume can tell a good
checkpoint from a damaged one before loading it.

DeepSpeed loads whatever bytes a shard holds: flipped bytes in an optimizer shard resume silently
with wrong moments, and a truncated or deleted shard fails only deep inside ``torch.load``. A
manifest, written by rank 0 as the last file of a save (before the ``.partial`` folder is renamed),
records what was written; :func:`verify` compares the tag with it.

``COMPLETE`` of a save that writes a manifest says so (``{"manifest": "MANIFEST.json"}``). That is
how a tag whose manifest went missing (damaged) is told apart from a tag written by an older dsclip,
which never had one: the latter is accepted, reported as unverified.

Files added to a tag after its save (``universal/``, made on demand from the verified shards, with its
own ``COMPLETE``) are not in the manifest and not checked.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsclip.checkpoint.layout import COMPLETE, MANIFEST

BLOCK = 1 << 20  # crc32 is streamed: a shard is never read into memory whole
VERSION = 1


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _files(tag_dir: Path) -> list[str]:
    """Paths (relative, '/'-separated, sorted) of every file under ``tag_dir`` but the manifest."""
    out = []
    for root, dirs, names in os.walk(tag_dir):
        dirs.sort()
        for name in names:
            rel = (Path(root) / name).relative_to(tag_dir).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def entry(path: Path) -> dict:
    """One file's manifest entry: its size and crc32."""
    return {"size": path.stat().st_size, "crc32": f"{crc32_file(path):08x}"}


def entries(tag_dir: Path, paths: list[str]) -> dict[str, dict]:
    """Entries of ``paths`` (files under ``tag_dir`` written by this rank), keyed as in the manifest: each
    rank checksums its own shards while they are in its page cache, in parallel, instead of rank 0 reading
    every rank's shards back (over the network file system, on several nodes)."""
    root, out = Path(tag_dir).resolve(), {}
    for path in paths:
        try:
            rel = Path(path).resolve().relative_to(root).as_posix()
        except ValueError:  # not part of this tag
            continue
        out[rel] = entry(root / rel)
    return out


def build(tag_dir: Path, known: dict[str, dict] | None = None) -> str:
    """The manifest text of ``tag_dir`` as it is now (the caller writes it to ``tag_dir/MANIFEST``).
    ``known``: entries the writing ranks computed (:func:`entries`); used while the file still has that
    size, every other file is checksummed here."""
    known, files = known or {}, {}
    for rel in _files(tag_dir):
        p = tag_dir / rel
        given = known.get(rel)
        files[rel] = given if given is not None and given["size"] == p.stat().st_size else entry(p)
    return json.dumps({"version": VERSION, "files": files}, indent=1)


@dataclass(frozen=True)
class Verdict:
    """The result of :func:`verify`: ``problem`` names what is wrong (None: the tag verifies);
    ``unverified``: no manifest because an older dsclip wrote the tag (accepted, not checked)."""

    problem: str | None = None
    unverified: bool = False

    @property
    def ok(self) -> bool:
        return self.problem is None


def _expects_manifest(tag_dir: Path) -> bool:
    try:
        marker = json.loads((tag_dir / COMPLETE).read_text() or "{}")
    except (OSError, ValueError):
        return True  # an unreadable COMPLETE is damage, not an old format
    return not isinstance(marker, dict) or "manifest" in marker


_RANK_RE = re.compile(r"(?:zero_pp_rank_|_rank)(\d+)")


def loading_rank(rel: str, world_size: int) -> int:
    """The rank that loads (and so verifies) the file ``rel`` of a tag on ``world_size`` ranks: a rank's own
    DeepSpeed shard (``zero_pp_rank_R_...``) or dsclip file (``ema_rankRRRRR.pt``) is rank R's (R mod the
    world: a tag saved on more ranks is still verified once per file, before the universal conversion reads
    it); the module file and the small shared files are rank 0's."""
    found = _RANK_RE.search(Path(rel).name)
    return int(found.group(1)) % max(world_size, 1) if found else 0


def verify(tag_dir: Path, *, checksums: bool = True, owned: Callable[[str], bool] | None = None) -> Verdict:
    """Check ``tag_dir`` against its manifest: every listed file present with its size and (``checksums``)
    its crc32. Sizes are checked for all files first, so a missing or truncated shard is found without
    reading the others. ``checksums=False``: sizes only (a stat per file, no reads). ``owned``: checksum
    only the files it accepts (each rank its share: :func:`loading_rank`)."""
    tag_dir = Path(tag_dir)
    mf = tag_dir / MANIFEST
    if not mf.is_file():
        if _expects_manifest(tag_dir):
            return Verdict(f"{MANIFEST} is missing (its save did not finish, or the file was deleted)")
        return Verdict(unverified=True)
    try:
        files = json.loads(mf.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Verdict(f"{MANIFEST} is unreadable ({e})")
    for rel, want in files.items():
        p = tag_dir / rel
        if not p.is_file():
            return Verdict(f"{rel} is missing")
        size = p.stat().st_size
        if size != want["size"]:
            what = "truncated" if size < want["size"] else "too long"
            return Verdict(f"{rel} is {what}: {size} bytes, expected {want['size']}")
    if checksums:
        for rel, want in files.items():
            if owned is not None and not owned(rel):
                continue
            found = f"{crc32_file(tag_dir / rel):08x}"
            if found != want["crc32"]:
                return Verdict(f"{rel} is corrupt: crc32 {found}, expected {want['crc32']}")
    return Verdict()
