"""Webdataset shard plumbing: URL expansion, existence checks, tar reading with bad-data accounting.

A sample is the group of consecutive tar members sharing a key (``dir/name`` up to the first dot of
the file name, as webdataset does): ``000123.jpg`` + ``000123.txt`` -> {"__key__": "000123",
"jpg": b"...", "txt": b"..."}. Reading never raises for bad data: a truncated tar or an unreadable
shard is logged, counted in ``stats`` and the reader moves on.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import braceexpand
from PIL import Image

from .sample_keys import DEFAULT_KEYS, SampleKeys

log = logging.getLogger("dsclip.data")

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # what `dsclip data write` stores; the reader: --image-key
_REMOTE = re.compile(r"^(pipe:|https?://|s3://|gs://|ais://)")
_WARN_LIMIT = 5  # warnings per reason per process; everything is still counted


class ShardError(ValueError):
    """A problem with the shard specification found before training (missing path, empty pattern)."""


def is_remote(url: str) -> bool:
    return bool(_REMOTE.match(url))


def expand_urls(spec: str) -> list[str]:
    """Brace-expand one source (``data/{00000..00099}.tar``); a spec without braces is one URL."""
    urls = []
    for part in spec.split():  # whitespace also separates patterns, as in webdataset
        urls.extend(braceexpand.braceexpand(part))
    return urls


def parse_sources(train_data: str, upsampling_factors: str | None = None) -> list[tuple[list[str], float]]:
    """``"a/{0..9}.tar::b/{0..3}.tar"`` -> [(urls_a, w_a), (urls_b, w_b)]; every URL checked to exist.

    Weights are per-shard sampling weights for resampled mode (OpenCLIP's
    --train-data-upsampling-factors; default 1.0 = uniform over shards).
    """
    if not train_data or not train_data.strip():
        raise ShardError("empty --train-data")
    specs = [s.strip() for s in train_data.split("::")]
    if upsampling_factors:
        factors = [float(f) for f in upsampling_factors.split("::")]
        if len(factors) != len(specs):
            raise ShardError(f"--train-data-upsampling-factors has {len(factors)} values for {len(specs)} sources")
        if any(f < 0 for f in factors) or sum(factors) <= 0:
            raise ShardError("--train-data-upsampling-factors must be non-negative and not all zero")
    else:
        factors = [1.0] * len(specs)
    out = []
    for spec, w in zip(specs, factors):
        if not spec:
            raise ShardError(f"empty source in --train-data {train_data!r}")
        urls = expand_urls(spec)
        if not urls:
            raise ShardError(f"pattern {spec!r} matches no shards")
        missing = [u for u in urls if not is_remote(u) and not os.path.isfile(u)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ShardError(f"shard not found: {missing[0]}{more}")
        out.append((urls, w))
    return out


def dataset_size(urls: list[str]) -> int | None:
    """Total samples from ``sizes.json`` files ({shard file name: count}) next to the shards, if complete."""
    cache: dict[str, dict] = {}
    total = 0
    for u in urls:
        if is_remote(u):
            return None
        d = os.path.dirname(u) or "."
        if d not in cache:
            p = Path(d) / "sizes.json"
            try:
                cache[d] = json.loads(p.read_text()) if p.is_file() else {}
            except (OSError, ValueError):
                cache[d] = {}
        n = cache[d].get(os.path.basename(u))
        if n is None:
            return None
        total += int(n)
    return total


def split_key(name: str) -> tuple[str, str] | None:
    """``"dir/000123.seg.jpg"`` -> ("dir/000123", "seg.jpg"); None for names without an extension."""
    d, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{d}/{stem}" if d else stem), ext.lower()


class BadData:
    """Counts bad samples by reason and rate-limits the warnings."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        if self.counts[reason] <= _WARN_LIMIT:
            extra = " (further ones counted silently)" if self.counts[reason] == _WARN_LIMIT else ""
            log.warning("skipping %s: %s%s", reason.replace("_", " "), where, extra)

    def take(self) -> dict[str, int]:
        """Counts since the last take (what a batch carries to the main process)."""
        out = dict(self.counts)
        self.counts = Counter()
        return out


def _open(url: str):
    if is_remote(url):
        from webdataset.gopen import gopen  # lazy: ImageLimits is read by the run config's parser (#33)

        return gopen(url, "rb")
    return open(url, "rb")


def iter_tar(url: str, bad: BadData) -> Iterator[dict]:
    """Samples of one tar shard, in file order. Incomplete trailing data of a truncated tar is dropped."""
    return (sample for sample, _ in iter_tar_members(url, bad))


def iter_tar_members(url: str, bad: BadData) -> Iterator[tuple[dict, list[tuple[str, int, int]]]]:
    """:func:`iter_tar`'s samples, each with its members' (ext, data offset, size) in file order (the offsets
    are file offsets for an uncompressed tar): what the shard index records."""
    try:
        stream = _open(url)
    except OSError as e:
        bad.add("unreadable_shard", f"{url} ({e.__class__.__name__}: {e})")
        return
    current: dict | None = None
    layout: list = []
    try:
        with stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                kx = split_key(member.name)
                if kx is None:
                    continue
                key, ext = kx
                data = tar.extractfile(member).read()
                if len(data) != member.size:
                    raise EOFError("member cut short")
                if current is not None and current["__key__"] != key:
                    yield current, layout
                    current = None
                if current is None:
                    current, layout = {"__key__": key, "__url__": url}, []
                current[ext] = data
                layout.append((ext, member.offset_data, member.size))
            end = tar.offset
        if not is_remote(url) and not _has_end_marker(url, end):
            # tarfile ends silently at a cut-off header: the last sample may be incomplete, drop it
            bad.add("truncated_tar", f"{url} (no end-of-archive marker after byte {end})")
            return
        if current is not None:
            yield current, layout
    except (tarfile.ReadError, EOFError, OSError, tarfile.TarError) as e:
        # tarfile reports a cut-off archive as ReadError/EOFError; an unreadable file as ReadError at open.
        reason = "truncated_tar" if current is not None or "unexpected end" in str(e).lower() else "unreadable_shard"
        bad.add(reason, f"{url} ({e.__class__.__name__}: {e})")


def _has_end_marker(path: str, offset: int) -> bool:
    """A complete tar has two zero 512-byte blocks where its last member ends."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            tail = f.read(1024)
    except OSError:
        return False
    return len(tail) == 1024 and not tail.strip(b"\0")


def image_bytes(sample: dict, keys: SampleKeys = DEFAULT_KEYS) -> bytes | None:
    """The image member's bytes under ``--image-key`` (dsclip.data.sample_keys), or None."""
    return keys.image(sample)


def captions_of(sample: dict, keys: SampleKeys = DEFAULT_KEYS) -> list[str]:
    """The sample's captions under ``--text-key`` / ``--json-text-key`` (dsclip.data.sample_keys)."""
    return keys.captions(sample)


def undecodable_caption(sample: dict, keys: SampleKeys = DEFAULT_KEYS) -> str | None:
    """What is wrong with a text caption member that is not UTF-8 (None when it is, or there is none)."""
    return keys.undecodable(sample)


def sample_problem(sample: dict, keys: SampleKeys = DEFAULT_KEYS) -> tuple[str, str] | None:
    """Raw-level validity (no decoding): (reason, what follows ``url:`` in the warning) for a sample without an
    image or a caption under ``keys``, or with a text caption that is not UTF-8 (it would train on replacement
    characters); None for a good one. The shard index records this per sample, so it depends on the member
    bytes alone."""
    key = sample["__key__"]
    if keys.image(sample) is None:
        return "missing_image", key
    problem = keys.undecodable(sample)
    if problem:
        return "undecodable_caption", f"{key} ({problem})"
    if not keys.captions(sample):
        return "missing_caption", key
    return None


def check_sample(sample: dict, bad: BadData, keys: SampleKeys = DEFAULT_KEYS) -> bool:
    """:func:`sample_problem`, counted in ``bad``: True for a good sample."""
    problem = sample_problem(sample, keys)
    if problem is not None:
        bad.add(problem[0], f"{sample['__url__']}:{problem[1]}")
    return problem is None


def check_first_shard(urls: list[str], keys: SampleKeys, samples: int = 16) -> None:
    """Start-up check: one line (ShardError) when the first readable samples of the first shard match none of
    ``keys``, naming the suffixes found and the flag to pass: the run would otherwise read every shard for
    nothing and stop on "no valid samples" (or wait on the other ranks). Local shards only: a remote stream
    (``pipe:``, ``s3://``) is not opened twice."""
    if not urls or is_remote(urls[0]):
        return
    first = []
    for s in iter_tar(urls[0], BadData()):
        first.append(s)
        if len(first) >= samples:
            break
    problem = keys.mismatch(first, urls[0])
    if problem:
        raise ShardError(problem)


@dataclass(frozen=True)
class ImageLimits:
    """``--min-image-size`` / ``--max-image-size``: pixels of an image's shorter / longer side (0: no limit)."""

    min_side: int = 0
    max_side: int = 0

    def problem(self, size: tuple[int, int]) -> tuple[str, str] | None:
        """(bad-data reason, what is wrong) for an image of ``size`` = (width, height) outside the limits."""
        w, h = size
        if self.min_side and min(w, h) < self.min_side:
            return "small_image", f"{w}x{h} < --min-image-size {self.min_side}"
        if self.max_side and max(w, h) > self.max_side:
            return "large_image", f"{w}x{h} > --max-image-size {self.max_side}"
        return None

    def check(self, data: bytes) -> tuple[str, str] | None:
        """:meth:`problem` from the file's header only (PIL reads the size without decoding the pixels)."""
        if not (self.min_side or self.max_side):
            return None
        with Image.open(io.BytesIO(data)) as img:
            return self.problem(img.size)


NO_LIMITS = ImageLimits()


def decode_image(data: bytes):
    """bytes -> RGB PIL image, fully decoded (so a corrupt file fails here, not later in a transform)."""

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")
