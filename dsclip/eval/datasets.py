"""Evaluation datasets: class folders (zero-shot) and image-caption sets (retrieval).

Both are map-style so every rank can take an interleaved shard of the same ordering:
- ``ClassFolderDataset(root)``: ``root/<class>/*.{jpg,png,...}``; display names from
  ``root/classnames.txt`` (one per line, in sorted-folder order), the built-in ImageNet-1k names when
  the folders are ImageNet WordNet ids (an ImageNet val folder), or the folder names ('_' -> ' ').
- ``TarImageDataset`` indexes local webdataset shards (header scan, no decoding) and reads members
  by offset; captions are kept in memory for the text side.
- ``load_retrieval_set(spec, ...)`` gives (image dataset, captions, text_to_image) for shards or a CSV
  (several captions per image: several lines of the text member, a json list field, or repeated CSV image
  paths); shards are read with --image-key / --text-key / --json-text-key, as training reads them.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tarfile
from pathlib import Path

from torch.utils.data import Dataset

from ..data.csv_data import read_csv
from ..data.sample_keys import DEFAULT_KEYS, SampleKeys
from ..data.shards import IMAGE_EXTS, check_first_shard, decode_image, parse_sources, split_key

log = logging.getLogger("dsclip.eval")
_IMG_SUFFIXES = {"." + e for e in IMAGE_EXTS} | {".bmp", ".gif", ".tif", ".tiff"}


WNID = re.compile(r"n\d{8}")


@functools.cache
def imagenet_classnames() -> dict[str, str]:
    """WordNet id -> OpenCLIP's ImageNet-1k class name, in WordNet-id order (the ImageNet label order).

    ``imagenet_classes.tsv`` = timm's ``imagenet_synsets.txt`` beside OpenCLIP's ``IMAGENET_CLASSNAMES``
    (copied here because open_clip is optional)."""
    rows = (Path(__file__).with_name("imagenet_classes.tsv")).read_text(encoding="utf-8").splitlines()
    return dict(r.split("\t", 1) for r in rows if r)


def folder_classnames(root: Path, folders: list[str]) -> list[str]:
    """Display names for class folders without a classnames.txt: ImageNet WordNet ids -> built-in names,
    readable folder names -> themselves ('_' -> ' '); anything else is an error asking for classnames.txt."""
    known = imagenet_classnames()
    if all(f in known for f in folders):
        return [known[f] for f in folders]
    bad = next((f for f in folders if WNID.fullmatch(f) or not any(c.isalpha() for c in f)), None)
    if bad is not None:
        what = "a WordNet id that is not an ImageNet-1k class" if WNID.fullmatch(bad) else "not a readable name"
        raise ValueError(
            f"{root}: class folder {bad!r} is {what}; write {root / 'classnames.txt'} with one class name per "
            f"line in sorted-folder order ({len(folders)} lines)"
        )
    return [f.replace("_", " ") for f in folders]


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
            names = folder_classnames(root, folders)
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


IMAGENET_V2_DIR = "ImageNetV2-matched-frequency"  # imagenetv2_pytorch's folder under OpenCLIP's --imagenet-v2


class ImageNetV2Dataset(ClassFolderDataset):
    """ImageNet-V2 as OpenCLIP reads it (``imagenetv2_pytorch.ImageNetV2Dataset``): class folders named by
    ImageNet label index ``0``..``999`` holding ``*.jpeg``, label = the folder's number; classes are all 1000
    ImageNet-1k names (a folder subset still competes against every class, as in OpenCLIP).

    ``root`` is OpenCLIP's ``--imagenet-v2`` location (holding ``ImageNetV2-matched-frequency/``) or that
    folder itself. Nothing is downloaded: dsclip reads a folder that is given."""

    def __init__(self, root: str | os.PathLike, transform):
        root = Path(root)
        if (root / IMAGENET_V2_DIR).is_dir():
            root = root / IMAGENET_V2_DIR
        if not root.is_dir():
            raise FileNotFoundError(f"--imagenet-v2 folder not found: {root}")
        self.classnames = list(imagenet_classnames().values())  # label order = WordNet-id order
        folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        bad = [f for f in folders if not (f.isdigit() and int(f) < len(self.classnames))]
        if bad or not folders:
            raise ValueError(
                f"--imagenet-v2 {root}: expected class folders 0..999 (imagenetv2_pytorch's layout, e.g. "
                f"{IMAGENET_V2_DIR}/0/*.jpeg), found {bad[0] if bad else 'none'!r}"
            )
        self.samples = [
            (str(p), int(f))
            for f in sorted(folders, key=int)
            for p in sorted((root / f).iterdir())
            if p.suffix.lower() in _IMG_SUFFIXES
        ]
        if not self.samples:
            raise ValueError(f"--imagenet-v2 {root}: no images in the class folders")
        self.labels = [label for _, label in self.samples]
        self.transform = transform


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


def index_shards(urls: list[str], max_samples: int | None = None, keys: SampleKeys = DEFAULT_KEYS):
    """Scan tar headers: (image entries, captions, text_to_image); samples without image/caption skipped."""
    entries, captions, t2i = [], [], []
    skipped = 0
    for url in urls:
        groups, order = _scan_shard(url, keys)
        for key in order:
            g = groups[key]
            img = keys.image(g)  # (offset, size) of the first --image-key member present
            caps = keys.captions(g)
            if img is None or not caps:
                skipped += 1
                continue
            img_idx = len(entries)
            entries.append((url, *img))
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


def _scan_shard(url: str, keys: SampleKeys) -> tuple[dict[str, dict], list[str]]:
    """{key: {image suffix: (offset, size), caption suffix: bytes}} of one shard, and the keys in file order."""
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
                if ext in keys.image_suffixes:
                    groups[key][ext] = (m.offset_data, m.size)
                elif ext in keys.text_suffixes:
                    groups[key][ext] = tar.extractfile(m).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        log.warning("eval shard %s unreadable or truncated (%s); using what was indexed", url, e)
    return groups, order


def load_retrieval_set(
    spec: str,
    transform,
    *,
    csv_img_key="filepath",
    csv_caption_key="title",
    csv_separator="\t",
    max_samples: int | None = None,
    keys: SampleKeys = DEFAULT_KEYS,
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
    entries, captions, t2i = index_shards(urls, max_samples, keys)
    if not entries:
        check_first_shard(urls, keys)  # the members found and the flag to pass, when the keys are the problem
        raise ValueError(f"no usable samples in {spec}")
    return TarImageDataset(entries, transform), captions, t2i
