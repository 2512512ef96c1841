"""Evaluation datasets: class folders (zero-shot) and image-caption sets (retrieval).

Both are map-style so every rank can take an interleaved shard of the same ordering:
- ``ClassFolderDataset(root)``: ``root/<class>/*.{jpg,png,...}``; display names from
  ``root/classnames.txt`` (one per line, in sorted-folder order) or the folder names ('_' -> ' ').
- ``TarImageDataset`` indexes local webdataset shards (header scan, no decoding) and reads members
  by offset; captions are kept in memory for the text side.
- ``load_retrieval_set(spec, ...)`` gives (image dataset, captions, text_to_image) for shards or a CSV
  (several captions per image: several txt lines, json "captions", or repeated CSV image paths).
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path

from torch.utils.data import Dataset

from ..data.csv_data import read_csv
from ..data.shards import IMAGE_EXTS, captions_of, decode_image, parse_sources, split_key

log = logging.getLogger("dsclip.eval")
_IMG_SUFFIXES = {"." + e for e in IMAGE_EXTS} | {".bmp", ".gif", ".tif", ".tiff"}


class ClassFolderDataset(Dataset):
    """(image tensor, label) for ``root/<class>/<image>``; attributes ``classnames``, ``labels``."""

    def __init__(self, root: str | os.PathLike, transform):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"zero-shot data folder not found: {root}")
        folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not folders:
            raise ValueError(f"{root}: no class folders")
        names_file = root / "classnames.txt"
        if names_file.is_file():
            names = [ln.strip() for ln in names_file.read_text(encoding="utf-8").splitlines() if ln.strip()]
            if len(names) != len(folders):
                raise ValueError(f"{names_file} has {len(names)} names for {len(folders)} class folders")
        else:
            names = [f.replace("_", " ") for f in folders]
        self.classnames = names
        self.samples: list[tuple[str, int]] = []
        for label, f in enumerate(folders):
            for p in sorted((root / f).iterdir()):
                if p.suffix.lower() in _IMG_SUFFIXES:
                    self.samples.append((str(p), label))
        if not self.samples:
            raise ValueError(f"{root}: no images in the class folders")
        self.labels = [label for _, label in self.samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return self.transform(decode_image(f.read())), label


class ImageFileDataset(Dataset):
    def __init__(self, paths: list[str], transform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as f:
            return self.transform(decode_image(f.read()))


class TarImageDataset(Dataset):
    """Random access to the images of local tar shards: ``entries[i] = (shard path, offset, size)``."""

    def __init__(self, entries: list[tuple[str, int, int]], transform):
        self.entries, self.transform = entries, transform

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        path, offset, size = self.entries[i]
        with open(path, "rb") as f:
            f.seek(offset)
            return self.transform(decode_image(f.read(size)))


def index_shards(urls: list[str], max_samples: int | None = None):
    """Scan tar headers: (image entries, captions, text_to_image); samples without image/caption skipped."""
    entries, captions, t2i = [], [], []
    skipped = 0
    for url in urls:
        groups: dict[str, dict] = {}
        order: list[str] = []
        try:
            with tarfile.open(url, "r:") as tar:
                for m in tar:
                    kx = split_key(m.name) if m.isfile() else None
                    if kx is None:
                        continue
                    key, ext = kx
                    if key not in groups:
                        groups[key] = {"__key__": key, "__url__": url}
                        order.append(key)
                    if ext in IMAGE_EXTS:
                        groups[key]["__img__"] = (m.offset_data, m.size)
                        groups[key][ext] = b""
                    elif ext in ("txt", "json"):
                        groups[key][ext] = tar.extractfile(m).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            log.warning("eval shard %s unreadable or truncated (%s); using what was indexed", url, e)
        for key in order:
            g = groups[key]
            caps = captions_of(g)
            if "__img__" not in g or not caps:
                skipped += 1
                continue
            img_idx = len(entries)
            entries.append((url, *g["__img__"]))
            for c in caps:
                captions.append(c)
                t2i.append(img_idx)
            if max_samples and len(entries) >= max_samples:
                break
        if max_samples and len(entries) >= max_samples:
            break
    if skipped:
        log.warning("eval data: skipped %d samples without image or caption", skipped)
    return entries, captions, t2i


def load_retrieval_set(
    spec: str,
    transform,
    *,
    csv_img_key="filepath",
    csv_caption_key="title",
    csv_separator="\t",
    max_samples: int | None = None,
):
    """(image dataset, captions, text_to_image) for webdataset shards or a CSV/TSV."""
    if spec.lower().endswith((".csv", ".tsv")):
        paths, caps = read_csv(spec, csv_img_key, csv_caption_key, csv_separator)
        index: dict[str, int] = {}
        images, captions, t2i = [], [], []
        for p, c in zip(paths, caps):
            if not c.strip():
                continue
            if p not in index:
                if max_samples and len(images) >= max_samples:
                    continue
                index[p] = len(images)
                images.append(p)
            captions.append(c.strip())
            t2i.append(index[p])
        return ImageFileDataset(images, transform), captions, t2i
    urls = [u for us, _ in parse_sources(spec) for u in us]
    entries, captions, t2i = index_shards(urls, max_samples)
    if not entries:
        raise ValueError(f"no usable samples in {spec}")
    return TarImageDataset(entries, transform), captions, t2i
