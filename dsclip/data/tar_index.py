"""Per-shard index of a webdataset tar: what lets a resume replay the epoch on sample numbers, not bytes.

``<shard>.idx`` sits beside its shard (``dsclip data write`` and ``dsclip data index`` write it; the training
loader writes it the first time it reads a shard without one), or under ``$DSCLIP_CACHE/tar-index`` (default
``~/.cache/dsclip``) when the shard's folder is not writable. Line 1 is a JSON header: the shard's size and
mtime when indexed, the member-name mapping (:class:`SampleFields`) the checks used, the number of samples
:func:`iter_tar` yields, the bad ones among them (number, reason, warning text) and the shard's own problem
(a truncated tar); that is all a resume needs for the shards it passes over. The rest is a JSON body, one
``[key, ext, offset, size, ext, offset, size, ...]`` per sample (data offsets of its members): read only for a
shard whose samples are read, each sample with one ``pread`` of its members' span.

The index is made by :func:`iter_tar_members`, the training reader itself, so its samples, their grouping and
its bad-data verdicts are exactly the stream's. A shard whose size or mtime differs from its index's stops
the run with one line (:class:`ShardChanged`): a resume would no longer replay what the run read.
Remote (``pipe:``, ``s3://``...) and compressed shards have no index: they are streamed as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from .shards import FIELDS, BadData, SampleFields, ShardError, is_remote, iter_tar_members, sample_problem

log = logging.getLogger("dsclip.data")

SUFFIX = ".idx"
VERSION = 1
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstd


class ShardChanged(ShardError):
    """A shard differs from the one its index describes."""


@dataclass
class ShardIndex:
    url: str
    samples: int  # samples iter_tar yields, good and bad
    bad: dict[int, tuple[str, str]]  # sample number -> (reason, the warning's text after "url:")
    end: tuple[str, str] | None  # the shard's own problem: (reason, the warning's text after the url)
    size: int
    mtime_ns: int
    path: str | None = None  # the .idx file (None: not written, the body is in memory)
    body_at: int = 0
    entries: list | None = field(default=None, repr=False)  # [key, ext, offset, size, ...] per sample

    def body(self) -> tuple[list, int]:
        """The per-sample entries and the bytes read for them."""
        if self.entries is not None:
            return self.entries, 0
        with open(self.path, "rb") as f:
            f.seek(self.body_at)
            raw = f.read()
        entries = json.loads(raw)
        if len(entries) != self.samples:
            raise ShardError(f"index {self.path} is damaged: delete it (it is rebuilt) or run `dsclip data index`")
        return entries, len(raw)


class _Recorder(BadData):
    """BadData that keeps each problem instead of warning: the index records them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def add(self, reason: str, where: str) -> None:
        self.seen.append((reason, where))


def _cache_root() -> Path:
    return Path(os.environ.get("DSCLIP_CACHE", Path.home() / ".cache" / "dsclip")) / "tar-index"


def index_paths(url: str) -> tuple[Path, Path]:
    """(beside the shard, in the cache): where its index is looked for, in this order."""
    real = os.path.realpath(url)
    tag = hashlib.sha1(real.encode()).hexdigest()[:16]
    return Path(url + SUFFIX), _cache_root() / f"{tag}-{os.path.basename(url)}{SUFFIX}"


def indexable(url: str) -> bool:
    """A local, uncompressed tar: its members can be read by offset."""
    if is_remote(url):
        return False
    try:
        with open(url, "rb") as f:
            head = f.read(6)
    except OSError:
        return True  # unreadable: build_index records it (not written)
    return not head.startswith(_COMPRESSED)


def _read_header(path: Path) -> tuple[dict, int] | None:
    try:
        with open(path, "rb", buffering=1024) as f:  # the header only: a resume reads every shard's
            line = f.readline()
    except OSError:
        return None
    try:
        head = json.loads(line)
    except ValueError:
        return None
    return (head, len(line)) if isinstance(head, dict) and head.get("version") == VERSION else None


def find_index(url: str, fields: SampleFields = FIELDS) -> ShardIndex | None:
    """The shard's index (header only), or None when there is none for this version and field mapping.
    Raises :class:`ShardChanged` when the shard is not the one indexed."""
    for path in index_paths(url):
        found = _read_header(path)
        if found is None or found[0].get("fields") != fields.signature():
            continue
        head, body_at = found
        st = os.stat(url)
        if (st.st_size, st.st_mtime_ns) != (head["size"], head["mtime_ns"]):
            raise ShardChanged(
                f"shard {url} changed since its index {path} was written (size {head['size']} -> {st.st_size} "
                f"bytes, mtime_ns {head['mtime_ns']} -> {st.st_mtime_ns}): a resume would not replay what the run "
                f"read; rebuild the index with `dsclip data index {url}` (or delete {path}), and resume from the "
                "start of the epoch"
            )
        return ShardIndex(
            url,
            head["samples"],
            {int(i): (r, t) for i, r, t in head["bad"]},
            tuple(head["end"]) if head["end"] else None,
            head["size"],
            head["mtime_ns"],
            str(path),
            body_at,
        )
    return None


def build_index(url: str, fields: SampleFields = FIELDS, write: bool = True) -> ShardIndex:
    """Index a local uncompressed tar by reading it once (:func:`iter_tar_members`); written beside the shard,
    else in the cache, when ``write`` (not for an unreadable shard, or one that changed while being read)."""
    try:
        st = os.stat(url)
    except OSError as e:
        return ShardIndex(url, 0, {}, ("unreadable_shard", f" ({e.__class__.__name__}: {e})"), 0, 0, entries=[])
    rec = _Recorder()
    entries, bad = [], {}
    for n, (sample, layout) in enumerate(iter_tar_members(url, rec)):
        entries.append([sample["__key__"], *(v for member in layout for v in member)])
        problem = sample_problem(sample, fields)
        if problem is not None:
            bad[n] = problem
    end = None
    if rec.seen:  # iter_tar_members reports only the shard's own problem, once, at its end
        reason, where = rec.seen[-1]
        end = reason, where[len(url) :]
    idx = ShardIndex(url, len(entries), bad, end, st.st_size, st.st_mtime_ns, entries=entries)
    again = os.stat(url)
    unreadable = end is not None and end[0] == "unreadable_shard" and not entries
    if write and not unreadable and (again.st_size, again.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
        _write(idx, fields)
    return idx


def _write(idx: ShardIndex, fields: SampleFields) -> None:
    head = {
        "version": VERSION,
        "shard": os.path.basename(idx.url),
        "size": idx.size,
        "mtime_ns": idx.mtime_ns,
        "fields": fields.signature(),
        "samples": idx.samples,
        "bad": [[n, r, t] for n, (r, t) in sorted(idx.bad.items())],
        "end": list(idx.end) if idx.end else None,
    }
    data = json.dumps(head, separators=(",", ":")).encode() + b"\n"
    data += json.dumps(idx.entries, separators=(",", ":")).encode() + b"\n"
    beside, cached = index_paths(idx.url)
    for path in (beside, cached) if os.access(beside.parent, os.W_OK) else (cached,):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # several workers may index one shard at once
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.debug("could not write %s: %s", path, e)
    log.warning("could not write the index of %s (beside it nor under %s): it is rebuilt when needed",
                idx.url, _cache_root())  # fmt: skip


def load_or_build(url: str, fields: SampleFields = FIELDS) -> ShardIndex | None:
    """The shard's index, built and written when missing; None for a shard that is streamed instead."""
    if not indexable(url):
        return None
    return find_index(url, fields) or build_index(url, fields)


class SampleReader:
    """Reads samples by their index entries: one ``pread`` per sample, a few shards open at once."""

    def __init__(self, keep_open: int = 8):
        self.keep_open = keep_open
        self.open: OrderedDict[str, tuple[int, list]] = OrderedDict()  # url -> (fd, entries)
        self.bytes_read = 0

    def _shard(self, idx: ShardIndex) -> tuple[int, list]:
        got = self.open.get(idx.url)
        if got is not None:
            self.open.move_to_end(idx.url)
            return got
        fd = os.open(idx.url, os.O_RDONLY)
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != (idx.size, idx.mtime_ns):
            os.close(fd)
            raise ShardChanged(
                f"shard {idx.url} changed during the run (size {idx.size} -> {st.st_size} bytes): rebuild its index "
                f"with `dsclip data index {idx.url}` and resume from the start of the epoch"
            )
        entries, nbytes = idx.body()
        self.bytes_read += nbytes
        self.open[idx.url] = fd, entries
        while len(self.open) > self.keep_open:
            os.close(self.open.popitem(last=False)[1][0])
        return fd, entries

    def read(self, idx: ShardIndex, n: int) -> dict:
        """Sample ``n`` of the shard, as :func:`iter_tar` yields it."""
        fd, entries = self._shard(idx)
        entry = entries[n]
        start, end = entry[2], entry[-2] + entry[-1]
        data = os.pread(fd, end - start, start)
        self.bytes_read += len(data)
        sample = {"__key__": entry[0], "__url__": idx.url}
        for j in range(1, len(entry), 3):
            off = entry[j + 1] - start
            sample[entry[j]] = data[off : off + entry[j + 2]]
        return sample

    def close(self) -> None:
        for fd, _ in self.open.values():
            os.close(fd)
        self.open.clear()
