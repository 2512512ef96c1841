"""Data input for dsclip: the demo set, webdataset shards, CSV files and OpenCLIP's synthetic set, behind one
``TrainData``.

Public API:
- ``DataConfig`` (dsclip.data.config): the data section of the run config.
- ``build_tokenizer(data_cfg, context_length, cache_dir)`` -> SentencePieceTokenizer
- ``build_train_data(data_cfg, *, tokenizer, image_size, batch_size, rank, world_size, seed)`` -> TrainData
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dsclip.lazy_exports import lazy_exports

from .config import DataConfig

if TYPE_CHECKING:
    from .loader import TrainData

# The readers load torch, torchvision, timm and webdataset, so they are imported on first use (PEP 562):
# the run config's parser reaches this package for DataConfig, and `dsclip train --help` must not pay for
# them (issue #33). name -> submodule.
_LAZY = {"TrainData": "loader", "MapStyleTrainData": "loader", "SentencePieceTokenizer": "tokenizer"}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["DataConfig", "TrainData", "SentencePieceTokenizer", "build_tokenizer", "build_train_data"]


def build_tokenizer(data_cfg: DataConfig, context_length: int, cache_dir: str | os.PathLike = ".cache/dsclip"):
    """The tokenizer the run uses: ``data_cfg.tokenizer`` if set, else the demo one for demo data."""
    from .demo import ensure_demo_tokenizer
    from .openclip_tokenizer import OpenCLIPTokenizer
    from .tokenizer import SentencePieceTokenizer

    if data_cfg.tokenizer and data_cfg.tokenizer.startswith("open_clip:"):
        # OpenCLIP's own tokenizer (open_clip_torch installed): what imported OpenCLIP text towers expect.

        return OpenCLIPTokenizer(data_cfg.tokenizer, context_length)
    if data_cfg.tokenizer:
        return SentencePieceTokenizer(data_cfg.tokenizer, context_length)
    if data_cfg.resolved_dataset_type() in ("demo", "synthetic"):  # synthetic: any tokenizer cuts its caption
        return SentencePieceTokenizer(ensure_demo_tokenizer(cache_dir), context_length)
    raise ValueError("no tokenizer: pass --tokenizer path/to/spm.model (train one with `dsclip tokenizer train`)")


def build_train_data(
    data_cfg: DataConfig,
    *,
    tokenizer,
    image_size: int,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
) -> TrainData:
    """Training input per ``data_cfg.dataset_type`` (see the TrainData contract in dsclip.data.loader)."""
    if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"bad batch_size/rank/world_size: {batch_size}/{rank}/{world_size}")
    from .csv_data import csv_train_dataset
    from .demo import DemoDataset
    from .loader import MapStyleTrainData
    from .synthetic import synthetic_train_dataset
    from .webdataset import build_wds_train_data

    image_size = data_cfg.force_image_size or image_size
    kind = data_cfg.resolved_dataset_type()
    if kind == "webdataset":
        return build_wds_train_data(
            data_cfg,
            tokenizer=tokenizer,
            image_size=image_size,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
    if kind == "demo":
        n = data_cfg.train_num_samples or data_cfg.demo_num_samples
        # fixed universe (the run seed sets the order); rendered at the model size, normalized, not augmented
        ds = DemoDataset(n, image_size=image_size, seed=0, mean=data_cfg.image_mean, std=data_cfg.image_std)
        name = "demo data"
    elif kind == "csv":
        ds, name = csv_train_dataset(data_cfg, image_size, seed)
    elif kind == "synthetic":
        ds, name = synthetic_train_dataset(data_cfg, image_size)
    else:
        raise ValueError(f"unknown dataset_type {kind!r}")
    # the map-style sets (demo, CSV, synthetic) share one loader: rank-sharded sampler, workers, tokenization
    return MapStyleTrainData(
        ds,
        tokenizer=tokenizer,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        workers=data_cfg.workers,
        name=name,
    )
