"""The built-in demo data: procedurally drawn shapes with captions that describe them.

Each sample is one shape (7 kinds) in one of 8 colours, small or large, at one of 5 positions, on one
of 3 background tones, with a little pixel noise and position jitter; its caption names some or all
of these attributes through one of several templates. A tiny CLIP can learn it on CPU in minutes
because every caption word is grounded in something visible, and the held-out split (a different
seed) gives a real zero-shot test: "a photo of a {shape}." prompts over the 7 shapes (chance 14%).

Everything is deterministic by (seed, index): the same sample comes back in any process, worker or
epoch, which is what makes resumption and multi-rank runs exact.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .tokenizer import train_sentencepiece
from .transforms import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, per_channel

SHAPES = ("circle", "square", "triangle", "cross", "star", "diamond", "ring")
COLORS = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.90, 0.10),
    "purple": (0.60, 0.15, 0.80),
    "orange": (1.00, 0.55, 0.05),
    "white": (0.97, 0.97, 0.97),
    "cyan": (0.10, 0.85, 0.90),
}
SIZES = {"small": 0.20, "large": 0.33}  # radius as a fraction of the image side
POSITIONS = {  # (x, y) centre as a fraction of the image side; phrase used in captions
    "left": ((0.30, 0.50), "on the left"),
    "right": ((0.70, 0.50), "on the right"),
    "top": ((0.50, 0.30), "at the top"),
    "bottom": ((0.50, 0.70), "at the bottom"),
    "center": ((0.50, 0.50), "in the center"),
}
BACKGROUNDS = {"black": (0.04, 0.04, 0.04), "gray": (0.35, 0.35, 0.35), "brown": (0.30, 0.20, 0.12)}

CAPTION_TEMPLATES = (
    "a {size} {color} {shape} {pos}",
    "a photo of a {size} {color} {shape} {pos}.",
    "a {color} {shape}.",
    "{size} {color} {shape}, {pos}",
    "a picture of a {color} {shape} {pos} on a {bg} background.",
    "there is a {size} {shape} {pos}. it is {color}.",
    "a {shape} in {color} on {bg}.",
    "a drawing of a {size} {shape}.",
)

# Zero-shot prompts (OpenCLIP-style "{c}" templates) for the held-out split.
DEMO_ZEROSHOT_TEMPLATES = ("a photo of a {c}.", "a {c}.", "a picture of a {c}.", "a drawing of a {c}.")
DEMO_HELDOUT_SEED_OFFSET = 1_000_003  # held-out images use seed + this: never seen in training

_SUPERSAMPLE = 2  # render at 2x and average-pool: cheap anti-aliasing so small shapes keep their form


def demo_zeroshot_classes(task: str = "shape") -> list[str]:
    """Class names for the demo zero-shot task: "shape" (7 classes), "color" (8), "color_shape" (56)."""
    if task == "shape":
        return list(SHAPES)
    if task == "color":
        return list(COLORS)
    if task == "color_shape":
        return [f"{c} {s}" for c in COLORS for s in SHAPES]
    raise ValueError(f"unknown demo zero-shot task {task!r}; use shape, color or color_shape")


def demo_zeroshot_templates() -> list[str]:
    return list(DEMO_ZEROSHOT_TEMPLATES)


def _shape_mask(shape: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Boolean mask for a unit-radius shape on coordinates relative to its centre (y points down)."""
    ax, ay = np.abs(x), np.abs(y)
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "square":
        return np.maximum(ax, ay) <= 0.82
    if shape == "triangle":  # apex up
        return (y <= 0.8) & (ax <= (y + 0.95) * 0.62)
    if shape == "cross":
        return ((ax <= 0.3) & (ay <= 0.95)) | ((ay <= 0.3) & (ax <= 0.95))
    if shape == "star":
        r = np.sqrt(x * x + y * y)
        theta = np.arctan2(y, x) + math.pi / 2  # one point straight up
        phase = np.mod(theta * 5 / (2 * math.pi), 1.0)
        return r <= 0.42 + 0.58 * np.abs(phase * 2 - 1)  # triangle wave in angle: 5 points
    if shape == "diamond":
        return ax + ay <= 1.0
    if shape == "ring":
        r2 = x * x + y * y
        return (r2 <= 1.0) & (r2 >= 0.55**2)
    raise ValueError(f"unknown shape {shape!r}")


class DemoDataset(Dataset):
    """Map-style procedural dataset: ``ds[i] -> (image (3, H, W) float normalized, caption str)``.

    ``seed`` selects the universe of samples; use :meth:`heldout` for the zero-shot split.
    ``transform``: optional callable on a PIL image replacing the built-in normalization.
    ``mean``/``std``: the built-in normalization's (``--image-mean``/``--image-std``; default OpenAI CLIP's).
    """

    def __init__(self, num_samples: int, image_size: int = 32, seed: int = 0, transform=None, mean=None, std=None):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if image_size < 16:
            raise ValueError(f"demo image_size must be >= 16, got {image_size}")
        self.num_samples = int(num_samples)
        self.image_size = int(image_size)
        self.seed = int(seed)
        self.transform = transform
        self._mean = torch.tensor(per_channel(mean, OPENAI_DATASET_MEAN)).view(3, 1, 1)
        self._std = torch.tensor(per_channel(std, OPENAI_DATASET_STD)).view(3, 1, 1)

    @classmethod
    def heldout(
        cls, num_samples: int, image_size: int = 32, seed: int = 0, transform=None, mean=None, std=None
    ) -> DemoDataset:
        """The held-out split for zero-shot evaluation (disjoint random stream from training)."""
        offset = seed + DEMO_HELDOUT_SEED_OFFSET
        return cls(num_samples, image_size=image_size, seed=offset, transform=transform, mean=mean, std=std)

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(index)])

    def attributes(self, index: int) -> dict:
        """The sampled attributes of sample ``index`` (shape, color, size, position, background, ...)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        rng = self._rng(index)
        attrs = {
            "shape": SHAPES[rng.integers(len(SHAPES))],
            "color": list(COLORS)[rng.integers(len(COLORS))],
            "size": list(SIZES)[rng.integers(len(SIZES))],
            "position": list(POSITIONS)[rng.integers(len(POSITIONS))],
            "background": list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))],
            "template": int(rng.integers(len(CAPTION_TEMPLATES))),
            "jitter": rng.uniform(-0.04, 0.04, size=2),
            "angle": float(rng.uniform(-0.25, 0.25)),  # small rotation (radians)
            "noise_seed": int(rng.integers(2**31)),
        }
        return attrs

    def label(self, index: int, task: str = "shape") -> int:
        a = self.attributes(index)
        if task == "shape":
            return SHAPES.index(a["shape"])
        if task == "color":
            return list(COLORS).index(a["color"])
        if task == "color_shape":
            return list(COLORS).index(a["color"]) * len(SHAPES) + SHAPES.index(a["shape"])
        raise ValueError(f"unknown demo zero-shot task {task!r}")

    @staticmethod
    def caption_for(attrs: dict) -> str:
        return CAPTION_TEMPLATES[attrs["template"]].format(
            size=attrs["size"],
            color=attrs["color"],
            shape=attrs["shape"],
            pos=POSITIONS[attrs["position"]][1],
            bg=attrs["background"],
        )

    def caption(self, index: int) -> str:
        return self.caption_for(self.attributes(index))

    def render(self, index: int) -> np.ndarray:
        """uint8 (H, W, 3) image of sample ``index``."""
        return self._render(self.attributes(index))

    def _render(self, a: dict) -> np.ndarray:
        s = self.image_size
        n = s * _SUPERSAMPLE
        coords = (np.arange(n, dtype=np.float32) + 0.5) / n  # pixel centres in [0, 1]
        yy, xx = np.meshgrid(coords, coords, indexing="ij")
        (cx, cy), _ = POSITIONS[a["position"]]
        cx, cy = cx + a["jitter"][0], cy + a["jitter"][1]
        radius = SIZES[a["size"]]
        dx, dy = (xx - cx) / radius, (yy - cy) / radius
        c, sn = math.cos(a["angle"]), math.sin(a["angle"])
        rx, ry = c * dx + sn * dy, -sn * dx + c * dy
        mask = _shape_mask(a["shape"], rx, ry).astype(np.float32)
        mask = mask.reshape(s, _SUPERSAMPLE, s, _SUPERSAMPLE).mean(axis=(1, 3))[..., None]  # (s, s, 1)
        bg = np.asarray(BACKGROUNDS[a["background"]], dtype=np.float32)
        fg = np.asarray(COLORS[a["color"]], dtype=np.float32)
        img = bg * (1.0 - mask) + fg * mask
        noise = np.random.default_rng(a["noise_seed"]).normal(0.0, 0.03, size=img.shape).astype(np.float32)
        img = np.clip(img + noise, 0.0, 1.0)
        return (img * 255.0 + 0.5).astype(np.uint8)

    def __getitem__(self, index: int):
        a = self.attributes(index)
        img = self._render(a)
        if self.transform is not None:
            image = self.transform(Image.fromarray(img))
        else:
            image = torch.from_numpy(img).permute(2, 0, 1).float().div_(255.0)
            image = (image - self._mean) / self._std
        return image, self.caption_for(a)


def all_demo_captions() -> list[str]:
    """Every caption the demo can produce (each attribute combination x template): the tokenizer corpus."""
    out = []
    for shape, color, size, pos, bg, t in itertools.product(
        SHAPES, COLORS, SIZES, POSITIONS, BACKGROUNDS, range(len(CAPTION_TEMPLATES))
    ):
        attrs = {
            "shape": shape,
            "color": color,
            "size": size,
            "position": pos,
            "background": bg,
            "template": t,
        }
        out.append(DemoDataset.caption_for(attrs))
    # Zero-shot prompts must tokenize well too.
    for task in ("shape", "color", "color_shape"):
        for c in demo_zeroshot_classes(task):
            out.extend(t.format(c=c) for t in DEMO_ZEROSHOT_TEMPLATES)
    return sorted(set(out))


DEMO_TOKENIZER_VERSION = 2
DEMO_TOKENIZER_VOCAB = 256


def ensure_demo_tokenizer(cache_dir: str | os.PathLike, vocab_size: int = DEMO_TOKENIZER_VOCAB) -> str:
    """Path to the demo sentencepiece model, training and caching it on first use.

    Safe to call from several ranks at once: training runs under a file lock and the model is
    written atomically, and a cached model is reused (the file name carries a version).
    """

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"demo_spm_v{DEMO_TOKENIZER_VERSION}_{vocab_size}.model"
    if path.exists():
        return str(path)

    with open(cache_dir / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first caller trains; the others wait and reuse
        try:
            if not path.exists():
                # BPE: on this small closed vocabulary it keeps every word whole (unigram would split them).
                train_sentencepiece(all_demo_captions(), str(path.with_suffix("")), vocab_size, model_type="bpe")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(path)


def write_demo_classfolder(
    root: str | os.PathLike,
    num_samples: int,
    image_size: int = 32,
    seed: int = 0,
    task: str = "shape",
    heldout: bool = True,
) -> str:
    """Write demo images as ``root/<class>/<index>.png`` (a class-folder zero-shot set) + classnames.txt."""

    root = Path(root)
    ds = (DemoDataset.heldout if heldout else DemoDataset)(num_samples, image_size=image_size, seed=seed)
    classes = demo_zeroshot_classes(task)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
    for i in range(num_samples):
        c = classes[ds.label(i, task)]
        Image.fromarray(ds.render(i)).save(root / c / f"{i:06d}.png")
    (root / "classnames.txt").write_text("\n".join(classes) + "\n")
    return str(root)
