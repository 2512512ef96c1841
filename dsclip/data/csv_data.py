"""CSV/TSV image-caption input (``--dataset-type csv``, ``--csv-img-key``, ``--csv-caption-key``).

Small local sets: the table is read once (image paths + captions), samples go through the same
per-epoch permutation as the demo data (exact batch counts on every rank, exact resume). Relative
image paths are resolved against the working directory, then against the CSV's own directory.
A sample whose image is missing or corrupt, or whose caption is empty, is replaced by the next good
one (deterministically) and counted, so a batch always has B rows.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path

from torch.utils.data import Dataset

from .loader import mix_seed
from .shards import NO_LIMITS, BadData, ImageLimits, decode_image
from .transforms import image_transform, seeded_rngs

log = logging.getLogger("dsclip.data")
_MAX_REPLACEMENTS = 100


def read_utf8(path: Path) -> str:
    """The text of a UTF-8 table (a leading BOM dropped); a file in another encoding (Latin-1 from Excel) is one
    ValueError naming the file, the line and the byte, and how to convert it, instead of the codec's
    "can't decode byte 0xe9 in position 1963"."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        byte = data[e.start : e.start + 1].hex()
        converted = path.with_name(f"{path.stem}.utf8{path.suffix}")
        raise ValueError(
            f"{path}: line {line}, column {column}: byte 0x{byte} is not UTF-8 (the file is in another encoding, "
            f"e.g. Latin-1); convert it: iconv -f latin1 -t utf-8 {path} > {converted}"
        ) from None


def read_csv(path: str | os.PathLike, img_key: str, caption_key: str, sep: str = "\t") -> tuple[list[str], list[str]]:
    """(image paths, captions) from a CSV/TSV; errors name the missing file or column."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"CSV not found: {p}")
    with io.StringIO(read_utf8(p), newline="") as f:
        reader = csv.DictReader(f, delimiter=sep)
        cols = reader.fieldnames or []
        for key, flag in ((img_key, "--csv-img-key"), (caption_key, "--csv-caption-key")):
            if key not in cols:
                raise ValueError(f"{p}: no column {key!r} ({flag}); columns are {cols} (separator {sep!r})")
        rows = [(r[img_key] or "", r[caption_key] or "") for r in reader]
    if not rows:
        raise ValueError(f"{p}: no rows")
    base = p.parent
    images = []
    for img, _ in rows:
        if img and not os.path.isabs(img) and not os.path.exists(img) and (base / img).exists():
            img = str(base / img)
        images.append(img)
    return images, [c for _, c in rows]


class CsvDataset(Dataset):
    """``get_sample(index, epoch) -> (image tensor, caption, bad-data counts)``, augmentation seeded by
    (seed, epoch, index) so results do not depend on the worker that loads them."""

    def __init__(
        self,
        images: list[str],
        captions: list[str],
        transform,
        seed: int = 0,
        image_limits: ImageLimits = NO_LIMITS,
    ):
        self.images, self.captions, self.transform, self.seed = images, captions, transform, seed
        self.image_limits = image_limits

    def __len__(self) -> int:
        return len(self.images)

    def _load(self, index: int, epoch: int, bad: BadData):
        path, caption = self.images[index], self.captions[index].strip()
        if not caption:
            bad.add("missing_caption", f"row {index} ({path})")
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            bad.add("missing_image", f"row {index} ({path}: {e.__class__.__name__})")
            return None
        try:
            img = decode_image(data)
        except Exception as e:  # PIL raises many types for corrupt data
            bad.add("corrupt_image", f"row {index} ({path}: {e.__class__.__name__}: {e})")
            return None
        problem = self.image_limits.problem(img.size)
        if problem is not None:
            bad.add(problem[0], f"row {index} ({path}: {problem[1]})")
            return None
        with seeded_rngs(mix_seed(self.seed, epoch, index)):
            return self.transform(img), caption

    def get_sample(self, index: int, epoch: int = 0):
        bad = BadData()
        for k in range(_MAX_REPLACEMENTS):
            out = self._load((index + k) % len(self), epoch, bad)
            if out is not None:
                return out[0], out[1], bad.take()
        raise RuntimeError(f"{_MAX_REPLACEMENTS} consecutive bad CSV rows from row {index}")

    def __getitem__(self, index: int):
        return self.get_sample(index)


def csv_train_dataset(data_cfg, image_size: int, seed: int) -> tuple[CsvDataset, str]:
    """The CSV training set and its name in logs (the loader is built by build_train_data)."""
    images, captions = read_csv(
        data_cfg.train_data, data_cfg.csv_img_key, data_cfg.csv_caption_key, data_cfg.csv_separator
    )
    # As in OpenCLIP, an epoch is the whole table (train_num_samples is not used for CSV input).
    ds = CsvDataset(
        images,
        captions,
        image_transform(image_size, is_train=True, **data_cfg.preprocess_args()),
        seed=seed,
        image_limits=data_cfg.image_limits(),
    )
    return ds, f"CSV {data_cfg.train_data}"
