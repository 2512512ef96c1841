"""Shard tools behind ``dsclip data`` and ``dsclip tokenizer``.

``dsclip data write``: image folder (+ captions TSV or sidecar .txt files) or a CSV -> webdataset
shards ``<out>/<prefix>-NNNNN.tar`` with ``key.{jpg|png|webp}``, ``key.txt``, ``key.json`` and a
``sizes.json`` ({shard: count}, what OpenCLIP and dsclip read for the epoch size). Each shard is
written to a temp file and renamed when complete; the manifest ``_progress.json`` records the next
input row, so an interrupted run resumes after the last complete shard (same options required).

``dsclip data index``: (re)build the per-shard index (``<shard>.idx``) a training resume replays on; ``write``
writes it with each shard, and training builds a missing one itself.
``dsclip data inspect``: per-shard sample counts, member extensions and broken samples.
``dsclip tokenizer train``: a sentencepiece model from a caption file, a CSV, or shards.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import logging
import os
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .sample_keys import DEFAULT_IMAGE_KEY, DEFAULT_KEYS, DEFAULT_TEXT_KEY, SampleKeys, split_keys
from .shards import (
    BadData,
    captions_of,
    decode_image,
    expand_urls,
    iter_tar,
    parse_sources,
    split_key,
)
from .tar_index import ShardChanged, build_index, find_index, indexable

# csv_data and tokenizer load torch (a torch Dataset, tensors): imported in the functions that read CSV or
# train a tokenizer, so `dsclip data --help` / `dsclip tokenizer --help` stay free of torch (issue #33).

log = logging.getLogger("dsclip.data")

_EXT_FOR_SUFFIX = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
_PIL_FORMAT = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


class DataToolError(ValueError):
    """A user-facing problem with the tool's input; the CLI prints it as one line."""


# ---------------------------------------------------------------------------------------------- inputs
def _folder_samples(images: Path, captions_file: Path | None) -> list[tuple[str, str]]:
    from .csv_data import read_utf8

    if not images.is_dir():
        raise DataToolError(f"image folder not found: {images}")
    if captions_file is not None:
        if not captions_file.is_file():
            raise DataToolError(f"captions file not found: {captions_file}")
        out = []
        for n, line in enumerate(read_utf8(captions_file).splitlines(), 1):  # non-UTF-8: one line, file and line
            if not line.strip():
                continue
            if "\t" not in line:
                raise DataToolError(f"{captions_file}:{n}: expected '<image path>\\t<caption>'")
            name, cap = line.split("\t", 1)
            out.append((str(images / name), cap.strip()))
        return out
    out = []
    for p in sorted(images.rglob("*")):
        if p.suffix.lower() in _EXT_FOR_SUFFIX:
            side = p.with_suffix(".txt")
            out.append((str(p), read_utf8(side).strip() if side.is_file() else ""))  # one line naming a non-UTF-8 file
    if not out:
        raise DataToolError(f"no images (.jpg/.jpeg/.png/.webp) under {images}")
    return out


def _csv_samples(path: Path, img_key: str, caption_key: str, sep: str) -> list[tuple[str, str]]:
    from .csv_data import read_csv

    try:
        images, captions = read_csv(path, img_key, caption_key, sep)
    except FileNotFoundError as e:
        raise DataToolError(str(e)) from None
    return list(zip(images, captions))


# ----------------------------------------------------------------------------------------------- write
def _encode(path: str, resize: int | None, verify: bool, quality: int = 95) -> tuple[bytes, str]:
    """(bytes, ext) for an image file; re-encoded as an RGB JPEG of ``quality`` when resizing (or when
    its format has no shard extension)."""
    with open(path, "rb") as f:
        data = f.read()
    ext = _EXT_FOR_SUFFIX.get(Path(path).suffix.lower())
    if resize or ext is None:
        img = decode_image(data)
        if resize:
            scale = resize / min(img.size)
            if scale < 1:
                img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        return buf.getvalue(), "jpg"
    if verify:
        decode_image(data)
    return data, ext


def _image_member(data: bytes, ext: str, keys: SampleKeys, quality: int) -> tuple[bytes, str]:
    """(bytes, member suffix) for an encoded image of format ``ext`` under ``--image-key``: its own suffix when
    the keys list it (the default keys list every format dsclip writes), else the first key's, re-encoded when
    that suffix names another format (``--image-key png`` stores PNGs); a suffix naming no format (``image``)
    stores the bytes as they are (readers tell the format from the bytes)."""
    wanted = keys.image_suffixes
    own = [k for k in wanted if _PIL_FORMAT.get(k) == _PIL_FORMAT[ext]]
    if own:
        return data, own[0]
    target = wanted[0]
    if target not in _PIL_FORMAT:
        return data, target
    buf = io.BytesIO()
    img = decode_image(data)
    img.save(buf, format=_PIL_FORMAT[target], **({"quality": quality} if target != "png" else {}))
    return buf.getvalue(), target


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    samples: list[tuple[str, str]],
    out_dir: str | os.PathLike,
    *,
    shard_size: int = 10000,
    max_shard_bytes: int | None = None,
    prefix: str = "shard",
    resize: int | None = None,
    quality: int = 95,
    verify: bool = True,
    progress: bool | None = None,
    keys: SampleKeys = DEFAULT_KEYS,
) -> dict:
    """Write (image path, caption) samples as shards; resumable. Returns {"shards", "samples", "skipped"}.
    ``keys``: the member suffixes (and .json field) the image and caption are stored under."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "_progress.json"
    options = {
        "shard_size": shard_size,
        "max_shard_bytes": max_shard_bytes,
        "prefix": prefix,
        "resize": resize,
        **({"quality": quality} if quality != 95 else {}),  # the default unrecorded: earlier runs still resume
        **({"keys": list(_key_options(keys))} if keys != DEFAULT_KEYS else {}),
        "num_inputs": len(samples),
    }
    if not 1 <= quality <= 100:
        raise DataToolError(f"--quality {quality}: JPEG quality is 1..100 (img2dataset's encode_quality; 95 default)")
    state = _progress_state(out, manifest_path, options)
    if manifest_path.is_file() and state["next_row"] >= len(samples):
        log.info("%s: already complete (%d shards)", out, len(state["sizes"]))
        return _summary(state, state["skipped"])
    for stale in out.glob(".*.tar.tmp"):
        stale.unlink()
    skipped = Counter(state["skipped"])
    if progress is None:
        progress = sys.stderr.isatty()

    bar = tqdm(total=len(samples), initial=state["next_row"], unit="img", disable=not progress, desc="shards")
    row = state["next_row"]
    while row < len(samples):
        name = f"{prefix}-{len(state['sizes']):05d}.tar"
        tmp = out / f".{name}.tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            add = functools.partial(
                _add_sample, tar, resize=resize, verify=verify, skipped=skipped, quality=quality, keys=keys
            )
            row, count = _fill_shard(add, samples, row, shard_size, max_shard_bytes, bar)
        if count == 0:
            tmp.unlink()
        else:
            os.replace(tmp, out / name)
            build_index(str(out / name), keys)  # the loader's resume replays on it (dsclip.data.tar_index)
            state["sizes"][name] = count
        state["next_row"] = row
        _save_progress(out, manifest_path, state, skipped)  # after the rename: a crash before it rewrites this shard
    bar.close()
    return _summary(state, skipped)


def _fill_shard(add, samples, row: int, shard_size: int, max_shard_bytes: int | None, bar) -> tuple[int, int]:
    """``add`` (_add_sample into one shard) samples from ``row`` on until the shard holds ``shard_size`` of
    them or ``max_shard_bytes``; unreadable ones add nothing. Returns (the next row, the samples written)."""
    count, nbytes = 0, 0
    while row < len(samples) and count < shard_size and not (max_shard_bytes and nbytes >= max_shard_bytes):
        path, caption = samples[row]
        written = add(f"{row:09d}", path, caption)
        row += 1
        bar.update(1)
        if written is not None:
            count += 1
            nbytes += written
    return row, count


def _save_progress(out: Path, manifest_path: Path, state: dict, skipped: Counter) -> None:
    """The resumable state and sizes.json, each replaced atomically."""
    state["skipped"] = dict(skipped)
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, manifest_path)
    sizes_tmp = out / ".sizes.json.tmp"
    sizes_tmp.write_text(json.dumps(state["sizes"], indent=1))
    os.replace(sizes_tmp, out / "sizes.json")


def _progress_state(out: Path, manifest_path: Path, options: dict) -> dict:
    """The resumable progress of an earlier run with the same options, or a fresh state."""
    if not manifest_path.is_file():
        return {"options": options, "next_row": 0, "sizes": {}, "skipped": {}}
    prev = json.loads(manifest_path.read_text())
    if prev.get("options") != options:
        raise DataToolError(
            f"{out} holds shards written with other options {prev.get('options')}; "
            "use the same options to resume or another --out"
        )
    if prev["next_row"] < options["num_inputs"]:
        log.info("resuming at input row %d (%d shards done)", prev["next_row"], len(prev["sizes"]))
    return prev


def _summary(state: dict, skipped: dict) -> dict:
    return {"shards": len(state["sizes"]), "samples": sum(state["sizes"].values()), "skipped": sum(skipped.values())}


def _key_options(keys: SampleKeys) -> tuple:
    return keys.image_key, keys.text_key, keys.json_text_key


def _add_sample(
    tar,
    key: str,
    path: str,
    caption: str,
    resize,
    verify: bool,
    skipped: Counter,
    quality: int = 95,
    keys: SampleKeys = DEFAULT_KEYS,
) -> int | None:
    """Add one sample's image, caption and metadata to ``tar``; bytes written, or None (counted in ``skipped``)."""
    if not caption.strip():
        skipped["missing_caption"] += 1
        log.warning("skipping %s: empty caption", path)
        return None
    try:
        data, ext = _image_member(*_encode(path, resize, verify, quality), keys, quality)
    except OSError as e:
        skipped["unreadable_image"] += 1
        log.warning("skipping %s: %s", path, e)
        return None
    except Exception as e:  # PIL: corrupt image
        skipped["corrupt_image"] += 1
        log.warning("skipping %s: corrupt image (%s)", path, e)
        return None
    text = caption.strip().encode("utf-8")
    field = keys.json_fields[0] if keys.json_fields else "caption"
    meta = json.dumps({field: caption.strip(), "source": os.path.basename(path)}).encode()
    _add(tar, f"{key}.{ext}", data)
    _add(tar, f"{key}.{split_keys(keys.text_key)[0]}", text)
    _add(tar, f"{key}.json", meta)
    return len(data) + len(text) + len(meta) + 3 * 512


# --------------------------------------------------------------------------------------------- inspect
def inspect_shards(
    pattern: str, decode: bool = True, max_shards: int | None = None, keys: SampleKeys = DEFAULT_KEYS
) -> dict:
    """Report per shard: samples, member extensions, broken samples by reason (read with ``keys``, as training
    reads them), and, for a shard with samples of which none matches the keys, the line naming the flag to use."""
    urls = []
    for spec in pattern.split("::"):
        urls.extend(expand_urls(spec))
    if not urls:
        raise DataToolError(f"pattern {pattern!r} matches no shards")
    missing = [u for u in urls if not os.path.isfile(u)]
    if missing:
        raise DataToolError(
            f"shard not found: {missing[0]}" + (f" (and {len(missing) - 1} more)" if missing[1:] else "")
        )
    report = {"shards": [], "total": Counter()}
    for url in urls[:max_shards]:
        entry = _inspect_shard(url, decode, keys)
        report["shards"].append(entry)
        report["total"].update({"shards": 1, "samples": entry["samples"], "good": entry["good"], **entry["broken"]})
    report["total"] = dict(report["total"])
    return report


def _inspect_shard(url: str, decode: bool, keys: SampleKeys) -> dict:
    bad = BadData()
    exts: Counter = Counter()
    first: list[dict] = []  # for the keys hint
    n = good = 0
    for s in iter_tar(url, bad):
        n += 1
        exts.update(k for k in s if not k.startswith("__"))
        if len(first) < 16:
            first.append(s)
        img = keys.image(s)
        if img is None:
            bad.counts["missing_image"] += 1
            continue
        if keys.undecodable(s):  # training skips these (dsclip.data.shards.check_sample)
            bad.counts["undecodable_caption"] += 1
            continue
        if not keys.captions(s):
            bad.counts["missing_caption"] += 1
            continue
        if decode:
            try:
                decode_image(img)
            except Exception:
                bad.counts["corrupt_image"] += 1
                continue
        good += 1
    entry = {"shard": url, "samples": n, "good": good, "extensions": dict(exts), "broken": dict(bad.counts)}
    hint = keys.mismatch(first, url) if good == 0 else None
    if hint:
        entry["keys_hint"] = hint
    return entry


# ----------------------------------------------------------------------------------------------- index
def index_shards(pattern: str, force: bool = False, keys: SampleKeys = DEFAULT_KEYS) -> dict:
    """Build the index of every local uncompressed shard of ``pattern`` (``::``-joined sources) that has none,
    or whose shard changed since (``force``: every one), reading samples with ``keys`` as training will.
    Returns counts of shards built, kept and streamed."""
    urls = [u for urls, _ in parse_sources(pattern) for u in urls]
    done: Counter = Counter()
    for url in urls:
        if not indexable(url):
            done["streamed"] += 1  # remote or compressed: read as a stream, no index
            continue
        try:
            idx = None if force else find_index(url, keys)
        except ShardChanged:
            idx = None
        if idx is not None:
            done["kept"] += 1
            continue
        idx = build_index(url, keys)
        done["built"] += 1
        done["samples"] += idx.samples
        done["bad"] += len(idx.bad)
    return dict(done)


# ------------------------------------------------------------------------------------------------- CLI
def _setup_logging():
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _write_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsclip data write", description="Write webdataset shards.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="Image folder (captions from --captions or <image>.txt side files).")
    src.add_argument("--csv", help="CSV/TSV with image paths and captions.")
    p.add_argument("--captions", help="TSV '<path relative to --images>\\t<caption>' per line.")
    p.add_argument("--csv-img-key", default="filepath")
    p.add_argument("--csv-caption-key", default="title")
    p.add_argument("--csv-separator", default="\t")
    p.add_argument("--out", required=True, help="Output folder.")
    p.add_argument("--shard-size", type=int, default=10000, help="Samples per shard (default 10000).")
    p.add_argument("--num-shards", type=int, help="Split evenly into this many shards (sets --shard-size).")
    p.add_argument("--max-shard-bytes", type=float, help="Also start a new shard past this many bytes (e.g. 1e9).")
    p.add_argument("--prefix", default="shard", help="Shard file name prefix.")
    p.add_argument(
        "--resize",
        type=int,
        help="Store shards pre-resized: downscale the shorter side to this many pixels and re-encode as an RGB "
        "JPEG of --quality, as img2dataset's resize_mode=keep_ratio (e.g. 256 for 224 px training: smaller shards, "
        "cheaper decode; RGB JPEGs are what nvJPEG takes on --data-decode gpu).",
    )
    p.add_argument(
        "--quality", type=int, default=95, help="JPEG quality of re-encoded images (img2dataset's encode_quality)."
    )
    p.add_argument("--no-verify", action="store_true", help="Do not decode images to check them.")
    _key_flags(p, "stored")
    return p


def _key_flags(p: argparse.ArgumentParser, verb: str) -> None:
    """--image-key / --text-key / --json-text-key: OpenCLIP main's names and defaults, as `dsclip train`'s."""
    p.add_argument(
        "--image-key",
        default=DEFAULT_IMAGE_KEY,
        help=f"Member suffix(es) the image is {verb} under, ';'-separated (default {DEFAULT_IMAGE_KEY}).",
    )
    p.add_argument(
        "--text-key",
        default=DEFAULT_TEXT_KEY,
        help=f"Member suffix(es) the caption text is {verb} under, ';'-separated (default {DEFAULT_TEXT_KEY}).",
    )
    p.add_argument(
        "--json-text-key",
        help=f"Field(s) of the .json member the caption is {verb} under, ';'-separated (takes precedence over "
        "--text-key when reading).",
    )


def _keys(a: argparse.Namespace) -> SampleKeys:
    keys = SampleKeys(a.image_key, a.text_key, a.json_text_key)
    text = split_keys(keys.text_key)[0]  # the suffix a caption is written under
    clash = ({"json", text} & set(keys.image_suffixes)) | ({"json"} & {text})
    if clash:
        raise DataToolError(
            f"--image-key {keys.image_key} / --text-key {keys.text_key} share the member .{clash.pop()} "
            "(.json holds the metadata; a caption in it is --json-text-key FIELD)"
        )
    return keys


def _inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsclip data inspect", description="Count samples and broken samples.")
    p.add_argument("shards", nargs="+", help="Shard pattern(s), e.g. 'data/shard-{00000..00099}.tar' or files.")
    p.add_argument("--no-decode", action="store_true", help="Skip image decoding (faster, misses corrupt images).")
    p.add_argument("--max-shards", type=int, help="Only the first N shards.")
    p.add_argument("--json", action="store_true", help="Print the report as JSON.")
    _key_flags(p, "read from")
    return p


def _index_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsclip data index",
        description="Build the per-shard index (<shard>.idx: sample counts, bad samples, member offsets) that lets a "
        "training resume skip to its position without reading the shards before it. `write` writes it with each "
        "shard and training builds a missing one; run this for shards written by other tools, or after changing one.",
    )
    p.add_argument("shards", nargs="+", help="Shard pattern(s), e.g. 'data/shard-{00000..00099}.tar' or files.")
    p.add_argument("--force", action="store_true", help="Rebuild every index, also the up-to-date ones.")
    _key_flags(p, "read from")
    return p


def _inspect_main(a) -> int:
    """Print ``dsclip data inspect``'s report."""
    rep = inspect_shards("::".join(a.shards), decode=not a.no_decode, max_shards=a.max_shards, keys=_keys(a))
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        for e in rep["shards"]:
            broken = ", ".join(f"{k}={v}" for k, v in sorted(e["broken"].items())) or "none"
            exts = ",".join(sorted(e["extensions"]))
            print(f"{e['shard']}: {e['samples']} samples, {e['good']} good, keys [{exts}], broken: {broken}")
            if "keys_hint" in e:
                print(f"  {e['keys_hint']}")
        t = rep["total"]
        extra = ", ".join(f"{k}={v}" for k, v in sorted(t.items()) if k not in ("shards", "samples", "good"))
        print(
            f"total: {t.get('shards', 0)} shards, {t.get('samples', 0)} samples, "
            f"{t.get('good', 0)} good" + (f", broken: {extra}" if extra else "")
        )
    return 0


def main_data(argv: list[str]) -> int:
    """``dsclip data [write] ...`` / ``dsclip data index ...`` / ``dsclip data inspect ...``; the exit code."""
    _setup_logging()
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: dsclip data {write,index,inspect} ...\n\n  write    write webdataset shards "
            "(image folder + captions, or CSV)\n  index    build the shard index a training resume replays on\n"
            "  inspect  count samples, keys and broken samples"
        )
        return 0
    try:
        if argv and argv[0] == "index":
            a = _index_parser().parse_args(argv[1:])
            r = index_shards("::".join(a.shards), force=a.force, keys=_keys(a))
            print(
                f"indexed {r.get('built', 0)} shards ({r.get('samples', 0)} samples, {r.get('bad', 0)} bad), "
                f"{r.get('kept', 0)} up to date, {r.get('streamed', 0)} remote or compressed (no index)"
            )
            return 0
        if argv and argv[0] == "inspect":
            return _inspect_main(_inspect_parser().parse_args(argv[1:]))
        a = _write_parser().parse_args(argv[1:] if argv and argv[0] == "write" else argv)
        if a.images:
            samples = _folder_samples(Path(a.images), Path(a.captions) if a.captions else None)
        else:
            samples = _csv_samples(Path(a.csv), a.csv_img_key, a.csv_caption_key, a.csv_separator)
        shard_size = a.shard_size
        if a.num_shards:
            shard_size = max(1, -(-len(samples) // a.num_shards))
        t0 = time.time()
        r = write_shards(
            samples,
            a.out,
            shard_size=shard_size,
            max_shard_bytes=int(a.max_shard_bytes) if a.max_shard_bytes else None,
            prefix=a.prefix,
            resize=a.resize,
            quality=a.quality,
            verify=not a.no_verify,
            keys=_keys(a),
        )
        print(
            f"wrote {r['samples']} samples in {r['shards']} shards to {a.out} ({r['skipped']} skipped, "
            f"{time.time() - t0:.1f}s); train with --train-data '{a.out}/{a.prefix}-"
            f"{{00000..{max(r['shards'] - 1, 0):05d}}}.tar'" + _train_key_flags(a)
        )
        return 0
    except (DataToolError, ValueError, FileNotFoundError) as e:
        print(f"dsclip data: error: {e}", file=sys.stderr)
        return 2


def _train_key_flags(a: argparse.Namespace) -> str:
    """The key flags `dsclip train` needs to read what was written (none with the defaults)."""
    out = ""
    for flag, value, default in (
        ("--image-key", a.image_key, DEFAULT_IMAGE_KEY),
        ("--text-key", a.text_key, DEFAULT_TEXT_KEY),
        ("--json-text-key", a.json_text_key, None),
    ):
        if value != default:
            out += f" {flag} '{value}'"
    return out


def _iter_captions(
    src: str, csv_caption_key: str, csv_separator: str, keys: SampleKeys = DEFAULT_KEYS
) -> Iterator[str]:
    from .csv_data import read_utf8

    if src.lower().endswith((".csv", ".tsv")):
        with io.StringIO(read_utf8(Path(src)), newline="") as f:
            reader = csv.DictReader(f, delimiter=csv_separator)
            if csv_caption_key not in (reader.fieldnames or []):
                raise DataToolError(f"{src}: no column {csv_caption_key!r}; columns are {reader.fieldnames}")
            for r in reader:
                yield r[csv_caption_key] or ""
        return
    if src.lower().endswith(".tar") or "{" in src or "::" in src:
        bad = BadData()
        for urls, _ in parse_sources(src):
            for url in urls:
                for s in iter_tar(url, bad):
                    yield from captions_of(s, keys)
        return
    if not os.path.isfile(src):
        raise DataToolError(f"caption source not found: {src}")
    with open(src, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\n")


def main_tokenizer(argv: list[str]) -> int:
    """``dsclip tokenizer train --input SRC --vocab-size N --out PREFIX``; returns the exit code."""
    _setup_logging()
    p = argparse.ArgumentParser(prog="dsclip tokenizer", description="Train a sentencepiece tokenizer.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="Train from a caption file (one per line), a CSV/TSV, or shards.")
    t.add_argument(
        "--input",
        required=True,
        action="append",
        help="Caption .txt file, CSV/TSV, or shard pattern (repeatable).",
    )
    t.add_argument("--out", required=True, help="Model prefix: writes PREFIX.model and PREFIX.vocab.")
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--model-type", default="unigram", choices=("unigram", "bpe", "char", "word"))
    t.add_argument("--max-sentences", type=int, default=2_000_000, help="Sentences sampled for training.")
    t.add_argument("--character-coverage", type=float, default=0.9995)
    t.add_argument("--csv-caption-key", default="title")
    t.add_argument("--csv-separator", default="\t")
    t.add_argument("--hard-vocab-limit", action="store_true", help="Fail if the corpus can't fill the vocab.")
    _key_flags(t, "read from (shard inputs)")
    t.add_argument(
        "--context-length",
        type=int,
        default=77,
        help="For the summary printed at the end: caption length distribution and the share cut at this length.",
    )
    a = p.parse_args(argv)
    from .tokenizer import SentencePieceTokenizer, length_summary, train_sentencepiece  # after the flags (#33)

    try:
        keys = _keys(a)

        def texts():
            for src in a.input:
                yield from _iter_captions(src, a.csv_caption_key, a.csv_separator, keys)

        path = train_sentencepiece(
            texts(),
            a.out,
            a.vocab_size,
            model_type=a.model_type,
            character_coverage=a.character_coverage,
            input_sentence_size=a.max_sentences,
            hard_vocab_limit=a.hard_vocab_limit,
        )
        tok = SentencePieceTokenizer(path, a.context_length)
        summary = length_summary(tok, texts())
    except (DataToolError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"dsclip tokenizer: error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {path}: vocab_size={tok.vocab_size} pad_id={tok.pad_id} eos_id={tok.eos_id} "
        f"(text_cfg: vocab_size {tok.vocab_size}, pool_type 'eos', eos_id {tok.eos_id}, pad_id {tok.pad_id})"
    )
    print(summary)
    return 0


__all__ = ["index_shards", "inspect_shards", "main_data", "main_tokenizer", "split_key", "write_shards"]
