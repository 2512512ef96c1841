"""Per-shard index of a webdataset tar: what lets a resume replay the epoch on sample numbers, not bytes.

``<shard>.idx`` sits beside its shard (``dsclip data write`` and ``dsclip data index`` write it; the training loader
writes it the first time it reads a shard without one), or under ``$DSCLIP_CACHE/tar-index`` (default
``~/.cache/dsclip``) when the shard's folder is not writable. Line 1 is a JSON header: the shard's size and mtime when
indexed, the member-name mapping the checks used (:class:`dsclip.data.sample_keys.SampleKeys`: ``--image-key``,
``--text-key``, ``--json-text-key``), the number of samples :func:`iter_tar` yields, the bad ones among them (number,
reason, warning text) and the shard's own problem (a truncated tar); that is all a resume needs for the shards it
passes over. The rest is the body (:class:`Layout`: the keys as a JSON line, then arrays of each sample's first member
and each member's extension, data offset and size), read only for a shard whose samples are read, each sample with one
``pread`` of its members' span.

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
import sys
import uuid
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .sample_keys import DEFAULT_KEYS, SampleKeys
from .shards import BadData, ShardError, is_remote, iter_tar_members, sample_problem

log = logging.getLogger("dsclip.data")

SUFFIX = ".idx"
VERSION = 2  # 1: a JSON body (never released)
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstd


class ShardChanged(ShardError):
    """A shard differs from the one its index describes."""


class Layout:
    """Where a shard's samples lie: sample n's key and the (extension, data offset, size) of each of its members,
    as flat arrays (a 10,000-sample shard's loads in a millisecond; JSON lists took 25 ms per 1,000)."""

    def __init__(self, keys: list[str], exts: list[str], first: array, ext_ids: array, offsets: array, sizes: array):
        self.keys, self.exts, self.first = keys, exts, first
        self.ext_ids, self.offsets, self.sizes = ext_ids, offsets, sizes

    @classmethod
    def of(cls, samples: list[tuple[str, list[tuple[str, int, int]]]]) -> Layout:
        """From (key, [(ext, offset, size), ...]) per sample."""
        exts: dict[str, int] = {}
        first, ext_ids, offsets, sizes = array("Q", [0]), array("H"), array("Q"), array("Q")
        for _, members in samples:
            for ext, off, size in members:
                ext_ids.append(exts.setdefault(ext, len(exts)))
                offsets.append(off)
                sizes.append(size)
            first.append(len(offsets))
        return cls([k for k, _ in samples], list(exts), first, ext_ids, offsets, sizes)

    def to_bytes(self) -> bytes:
        head = json.dumps({"keys": self.keys, "exts": self.exts, "byteorder": sys.byteorder}, separators=(",", ":"))
        arrays = (self.first, self.ext_ids, self.offsets, self.sizes)
        return head.encode() + b"\n" + b"".join(a.tobytes() for a in arrays)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Layout:
        line, _, rest = raw.partition(b"\n")
        head = json.loads(line)
        n, out, pos = len(head["keys"]), [], 0
        first = array("Q")
        first.frombytes(rest[: (n + 1) * first.itemsize])
        members = first[-1] if n else 0
        pos = len(first) * first.itemsize
        for code, count in (("H", members), ("Q", members), ("Q", members)):
            a = array(code)
            a.frombytes(rest[pos : pos + count * a.itemsize])
            pos += count * a.itemsize
            out.append(a)
        if head["byteorder"] != sys.byteorder:
            for a in (first, *out):
                a.byteswap()
        return cls(head["keys"], head["exts"], first, *out)

    def __len__(self) -> int:
        return len(self.keys)

    def span(self, n: int) -> tuple[int, int]:
        """Sample n's bytes: from its first member's data to its last member's end."""
        a, b = self.first[n], self.first[n + 1] - 1
        return self.offsets[a], self.offsets[b] + self.sizes[b]

    def sample(self, n: int, url: str, data: bytes, start: int) -> dict:
        """Sample n as :func:`iter_tar` yields it, from ``data`` = the file's bytes from ``start`` on."""
        out = {"__key__": self.keys[n], "__url__": url}
        for m in range(self.first[n], self.first[n + 1]):
            off = self.offsets[m] - start
            out[self.exts[self.ext_ids[m]]] = data[off : off + self.sizes[m]]
        return out


@dataclass
class ShardIndex:
    url: str
    samples: int  # samples iter_tar yields, good and bad
    bad: dict[int, tuple[str, str]]  # sample number -> (reason, the warning's text after "url:")
    end: tuple[str, str] | None  # the shard's own problem: (reason, the warning's text after the url)
    size: int
    mtime_ns: int
    path: str | None = None  # the .idx file (None: not written, the layout is in memory)
    body_at: int = 0
    layout: Layout | None = field(default=None, repr=False)

    def body(self) -> tuple[Layout, int]:
        """The shard's layout and the bytes read for it."""
        if self.layout is not None:
            return self.layout, 0
        with open(self.path, "rb") as f:
            f.seek(self.body_at)
            raw = f.read()
        try:
            layout = Layout.from_bytes(raw)
        except (ValueError, KeyError, IndexError):
            layout = None
        if layout is None or len(layout) != self.samples:
            raise ShardError(f"index {self.path} is damaged: delete it (it is rebuilt) or run `dsclip data index`")
        return layout, len(raw)


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


def find_index(url: str, keys: SampleKeys = DEFAULT_KEYS) -> ShardIndex | None:
    """The shard's index (header only), or None when there is none for this version and field mapping.
    Raises :class:`ShardChanged` when the shard is not the one indexed."""
    for path in index_paths(url):
        found = _read_header(path)
        if found is None or found[0].get("fields") != keys.signature():
            continue
        head, body_at = found
        st = os.stat(url)
        if (st.st_size, st.st_mtime_ns) != (head["size"], head["mtime_ns"]):
            what = f"size {head['size']} -> {st.st_size} bytes" if st.st_size != head["size"] else "modified"
            raise ShardChanged(
                f"shard {url} changed since it was indexed ({what}; index {path}): rebuild the index with "
                f"`dsclip data index {url}` (or delete {path}); a run resumed across the change cannot replay what "
                "it read: resume it from the start of an epoch"
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


def find_indexes(urls: list[str], keys: SampleKeys = DEFAULT_KEYS) -> list[ShardIndex | None]:
    """:func:`find_index` of every local shard (None for a remote one, or where there is no index), the small
    header reads overlapped in threads: thousands of shards on a network file system start in seconds."""

    def one(url: str) -> ShardIndex | None:
        return None if is_remote(url) else find_index(url, keys)

    if len(urls) < 64:
        return [one(u) for u in urls]
    with ThreadPoolExecutor(16, thread_name_prefix="dsclip-index") as pool:  # ends its threads on return
        return list(pool.map(one, urls))


def build_index(url: str, keys: SampleKeys = DEFAULT_KEYS, write: bool = True) -> ShardIndex:
    """Index a local uncompressed tar by reading it once (:func:`iter_tar_members`); written beside the shard,
    else in the cache, when ``write`` (not for an unreadable shard, or one that changed while being read)."""
    try:
        st = os.stat(url)
    except OSError as e:
        problem = "unreadable_shard", f" ({e.__class__.__name__}: {e})"
        return ShardIndex(url, 0, {}, problem, 0, 0, layout=Layout.of([]))
    rec = _Recorder()
    samples, bad = [], {}
    for n, (sample, members) in enumerate(iter_tar_members(url, rec)):
        samples.append((sample["__key__"], members))
        problem = sample_problem(sample, keys)
        if problem is not None:
            bad[n] = problem
    end = None
    if rec.seen:  # iter_tar_members reports only the shard's own problem, once, at its end
        reason, where = rec.seen[-1]
        end = reason, where[len(url) :]
    idx = ShardIndex(url, len(samples), bad, end, st.st_size, st.st_mtime_ns, layout=Layout.of(samples))
    again = os.stat(url)
    unreadable = end is not None and end[0] == "unreadable_shard" and not samples
    if write and not unreadable and (again.st_size, again.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
        _write(idx, keys)
    return idx


def _write(idx: ShardIndex, keys: SampleKeys) -> None:
    head = {
        "version": VERSION,
        "shard": os.path.basename(idx.url),
        "size": idx.size,
        "mtime_ns": idx.mtime_ns,
        "fields": keys.signature(),
        "samples": idx.samples,
        "bad": [[n, r, t] for n, (r, t) in sorted(idx.bad.items())],
        "end": list(idx.end) if idx.end else None,
    }
    data = json.dumps(head, separators=(",", ":")).encode() + b"\n"
    data += idx.layout.to_bytes()
    beside, cached = index_paths(idx.url)
    for path in (beside, cached) if os.access(beside.parent, os.W_OK) else (cached,):
        # several workers, on several nodes, may index one shard at once: each writes its own file, one wins
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
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


def load_or_build(url: str, keys: SampleKeys = DEFAULT_KEYS) -> ShardIndex | None:
    """The shard's index, built and written when missing; None for a shard that is streamed instead."""
    if not indexable(url):
        return None
    return find_index(url, keys) or build_index(url, keys)


class SampleReader:
    """Reads samples by their index entries: one ``pread`` per sample, a batch's reads in parallel threads (a
    shuffled batch's samples lie scattered over the shards its buffer spans: their latencies overlap), the
    shards of recent batches kept open."""

    def __init__(self, keep_open: int = 32, threads: int = 16):
        self.keep_open, self.threads = keep_open, threads
        self.open: OrderedDict[str, tuple[int, Layout]] = OrderedDict()  # url -> (fd, layout)
        self.bytes_read = 0
        self._pool: ThreadPoolExecutor | None = None  # made in the process that reads (a DataLoader worker)

    def read_many(self, refs: list[tuple[ShardIndex, int]]) -> list[dict]:
        """Samples ``(shard index, sample number)``, each as :func:`iter_tar` yields it."""
        if self._pool is None and len(refs) > 1 and self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dsclip-read")
        pmap = self._pool.map if self._pool is not None else map
        new = list({idx.url: idx for idx, _ in refs if idx.url not in self.open}.values())
        for idx, (fd, layout, nbytes) in zip(new, pmap(_open_shard, new)):  # a resume's buffer spans many shards
            self.open[idx.url] = fd, layout
            self.bytes_read += nbytes
        spans = []
        for idx, n in refs:
            fd, layout = self.open[idx.url]
            self.open.move_to_end(idx.url)
            spans.append((fd, *layout.span(n), layout, n, idx.url))
        out = []
        for (_, start, _, layout, n, url), data in zip(spans, pmap(_pread, spans)):
            self.bytes_read += len(data)
            out.append(layout.sample(n, url, data, start))
        while len(self.open) > self.keep_open:  # after the reads: never a shard this batch still reads
            os.close(self.open.popitem(last=False)[1][0])
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd, _ in self.open.values():
            os.close(fd)
        self.open.clear()


def _open_shard(idx: ShardIndex) -> tuple[int, Layout, int]:
    """(file descriptor, layout, bytes read for the layout) of a shard, checked against its index."""
    fd = os.open(idx.url, os.O_RDONLY)
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != (idx.size, idx.mtime_ns):
        os.close(fd)
        raise ShardChanged(
            f"shard {idx.url} changed during the run (size {idx.size} -> {st.st_size} bytes): rebuild its index "
            f"with `dsclip data index {idx.url}` and resume from the start of the epoch"
        )
    return fd, *idx.body()


def _pread(span) -> bytes:
    fd, start, end = span[:3]
    return os.pread(fd, end - start, start)
