"""Run evaluation on every rank: each rank encodes its shard, features are all-gathered.

Why not rank 0 alone: under ZeRO-3 every forward all-gathers parameter shards, so a forward on one
rank waits forever for the others. Here every rank runs the same number of forward passes (shards
are padded to equal length by wrapping around), then ``all_gather`` gives every rank the full
feature matrix in dataset order, and the metrics are computed identically everywhere.
With world size 1 (or no process group) nothing distributed is touched.

The model is called through its ``forward(image=...)`` / ``forward(text=...)`` (which returns
normalized ``image_features`` / ``text_features``), so a DeepSpeed engine can be passed directly:
its forward hooks gather ZeRO-3 parameters.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset

from dsclip.dist import rank_world

from ..data.demo import DemoDataset, demo_zeroshot_classes, demo_zeroshot_templates
from ..data.loader import shutdown_loader, signal_safe_loader
from ..data.transforms import image_transform
from .datasets import ClassFolderDataset, ImageNetV2Dataset, load_retrieval_set
from .retrieval import retrieval_metrics
from .templates import load_templates
from .zero_shot import class_embeddings, expand_prompts, zeroshot_topk


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Interleaved shard of range(n) for ``rank``, padded by wrapping so all ranks get ceil(n/world)."""
    per_rank = math.ceil(n / world_size)
    return [(rank + world_size * j) % n for j in range(per_rank)]


def gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`shard_indices`: all ranks' (per_rank, ...) rows -> (n, ...) in dataset order."""
    rank, world = rank_world()
    if world == 1:
        return local[:n]
    send = local.contiguous()
    if dist.get_backend() == "gloo" and send.is_cuda:
        send = send.cpu()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    stacked = torch.stack(parts, dim=1).to(local.device)  # (per_rank, world, ...): position j*world + r
    return stacked.reshape(-1, *local.shape[1:])[:n]


def _infer_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _infer_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def eval_loader(dataset: Dataset, *, batch_size: int = 256, workers: int = 0, persistent: bool = False) -> DataLoader:
    """This rank's shard of ``dataset`` in batches. ``persistent``: keep the worker processes alive
    between passes (the training evaluator reuses one loader per dataset: starting workers for every
    evaluation cost more than encoding a digits-sized set, bench/results/eval-cost_cpu2_2026-11-30.md)."""
    rank, world = rank_world()
    return signal_safe_loader(  # the rank, not a group SIGTERM, ends them: a persistent one must be closed
        Subset(dataset, shard_indices(len(dataset), rank, world)),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=_stack_first,
        persistent_workers=persistent and workers > 0,
    )


def encode_dataset(
    model,
    dataset: Dataset,
    kind: str,
    *,
    batch_size: int = 256,
    device=None,
    workers: int = 0,
    input_dtype: torch.dtype | None = None,
    loader: DataLoader | None = None,
    inference: bool = True,
) -> torch.Tensor:
    """(len(dataset), D) float32 features on every rank. ``dataset[i]`` is an image (3,H,W) or a
    token row (L,) (or a tuple whose first element is); ``kind`` is "image" or "text".

    ``loader``: a prebuilt :func:`eval_loader` of ``dataset`` (kept between evaluations).
    ``inference``: run under ``torch.inference_mode`` (no autograd bookkeeping at all, no version
    counters); ``False`` gives ``torch.no_grad``, which a ZeRO-3 engine needs (DeepSpeed's parameter
    gathering writes to tensors that inference mode would not let it touch)."""
    if kind not in ("image", "text"):
        raise ValueError(f"kind must be image or text, got {kind!r}")
    n = len(dataset)
    if n == 0:
        raise ValueError(f"cannot encode an empty {kind} dataset")
    device = torch.device(device) if device is not None else _infer_device(model)
    input_dtype = input_dtype or _infer_dtype(model)
    loader = loader if loader is not None else eval_loader(dataset, batch_size=batch_size, workers=workers)
    feats = []
    with torch.inference_mode() if inference else torch.no_grad():
        for x in loader:  # the same number of batches on every rank (equal shard lengths)
            x = x.to(device, non_blocking=True)
            if kind == "image":
                out = model(image=x.to(input_dtype))["image_features"]
            else:
                out = model(text=x)["text_features"]
            feats.append(out.float())
        local = torch.cat(feats)
    # out of inference mode: later arithmetic on the features (metrics, tests) may need autograd-free
    # ordinary tensors; the clone is (n, D) floats
    return gather_rows(local.clone() if inference else local, n)


def _stack_first(samples):
    return torch.stack([_first(s) for s in samples])


class _Rows(Dataset):
    def __init__(self, t: torch.Tensor):
        self.t = t

    def __len__(self):
        return self.t.shape[0]

    def __getitem__(self, i):
        return self.t[i]


@torch.no_grad()
def zeroshot_classifier(
    model,
    tokenizer,
    classnames: list[str],
    templates: list[str],
    *,
    batch_size: int = 256,
    device=None,
    tokens: torch.Tensor | None = None,
    inference: bool = True,
) -> torch.Tensor:
    """(C, D) class embeddings: every prompt encoded (sharded over ranks), averaged per class.
    ``tokens``: the prompts already tokenized (the training evaluator tokenizes them once)."""
    tokens = tokens if tokens is not None else tokenizer(expand_prompts(classnames, templates))
    with eval_mode(model):
        feats = encode_dataset(model, _Rows(tokens), "text", batch_size=batch_size, device=device, inference=inference)
    return class_embeddings(feats, len(classnames))


@torch.no_grad()
def evaluate_zeroshot(
    model,
    tokenizer,
    dataset: Dataset,
    labels,
    classnames: list[str],
    templates: list[str],
    *,
    batch_size: int = 256,
    device=None,
    workers: int = 0,
    image_loader: DataLoader | None = None,
    prompt_tokens: torch.Tensor | None = None,
    inference: bool = True,
) -> dict[str, float]:
    """Top-1/top-5 of ``dataset`` (images, or (image, label) tuples) against prompt-built classes."""
    with eval_mode(model):
        classifier = zeroshot_classifier(
            model,
            tokenizer,
            classnames,
            templates,
            batch_size=batch_size,
            device=device,
            tokens=prompt_tokens,
            inference=inference,
        )
        feats = encode_dataset(
            model,
            dataset,
            "image",
            batch_size=batch_size,
            device=device,
            workers=workers,
            loader=image_loader,
            inference=inference,
        )
    out = zeroshot_topk(feats, torch.as_tensor(labels, device=feats.device), classifier.to(feats.device))
    return {**out, "num_samples": len(dataset), "num_classes": len(classnames)}


@torch.no_grad()
def evaluate_retrieval(
    model,
    tokenizer,
    image_dataset: Dataset,
    captions: list[str],
    text_to_image,
    *,
    batch_size: int = 256,
    device=None,
    workers: int = 0,
    image_loader: DataLoader | None = None,
    caption_tokens: torch.Tensor | None = None,
    inference: bool = True,
) -> dict[str, float]:
    """Retrieval metrics for images and their captions (``text_to_image[t]`` = image of caption t)."""
    tokens = caption_tokens if caption_tokens is not None else tokenizer(list(captions))
    with eval_mode(model):
        img = encode_dataset(
            model,
            image_dataset,
            "image",
            batch_size=batch_size,
            device=device,
            workers=workers,
            loader=image_loader,
            inference=inference,
        )
        txt = encode_dataset(model, _Rows(tokens), "text", batch_size=batch_size, device=device, inference=inference)
    out = retrieval_metrics(img, txt, torch.as_tensor(text_to_image, device=img.device))
    return {**out, "num_images": img.shape[0], "num_texts": txt.shape[0]}


@torch.no_grad()
def evaluate_demo_zeroshot(
    model,
    tokenizer,
    *,
    image_size: int = 32,
    num_samples: int = 1000,
    task: str = "shape",
    templates: list[str] | None = None,
    batch_size: int = 256,
    device=None,
    retrieval: bool = False,
    mean=None,
    std=None,
    inference: bool = True,
) -> dict[str, float]:
    """Zero-shot accuracy on held-out demo images (never seen in training): {"top1", "top5", ...}.

    ``task``: "shape" (7 classes), "color" (8) or "color_shape" (56). With ``retrieval=True`` also
    the retrieval metrics of those images against their own captions (prefixed ``retrieval_``;
    demo captions are often shared by several images, so these are pessimistic). ``mean``/``std``:
    the normalization the model was trained with (``--image-mean``/``--image-std``).
    """

    ds = DemoDataset.heldout(num_samples, image_size=image_size, mean=mean, std=std)
    labels = [ds.label(i, task) for i in range(num_samples)]
    out = evaluate_zeroshot(
        model,
        tokenizer,
        ds,
        labels,
        demo_zeroshot_classes(task),
        templates or demo_zeroshot_templates(),
        batch_size=batch_size,
        device=device,
        inference=inference,
    )
    if retrieval:
        r = evaluate_retrieval(
            model,
            tokenizer,
            ds,
            [ds.caption(i) for i in range(num_samples)],
            list(range(num_samples)),
            batch_size=batch_size,
            device=device,
            inference=inference,
        )
        out.update({f"retrieval_{k}": v for k, v in r.items()})
    return out


class Evaluator:
    """The periodic evaluation the training loop runs (on ALL ranks), configured by the DataConfig.

    ``zeroshot(model)`` uses ``zeroshot_data`` (a class folder, or "demo" for the held-out demo set)
    with ``zeroshot_templates``, and ``imagenet_v2`` (OpenCLIP's ImageNet-V2 folder); ``retrieval(model)``
    uses ``val_data`` (shards or CSV). Datasets are indexed once and reused. Returned keys:
    ``zeroshot-top1``, ``zeroshot-top5``, ``imagenetv2-zeroshot-val-top1/top5`` and OpenCLIP's retrieval names
    (``image_to_text_R@1``, ..., ``text_to_image_median_rank``).
    """

    def __init__(
        self,
        data_cfg,
        *,
        tokenizer,
        image_size: int,
        batch_size: int = 256,
        device=None,
        workers: int | None = None,
        inference: bool = True,
    ):
        self.cfg, self.tokenizer = data_cfg, tokenizer
        self.image_size = data_cfg.force_image_size or image_size
        self.batch_size, self.device = batch_size, device
        self.workers = data_cfg.workers if workers is None else workers
        self.inference = inference  # torch.inference_mode (False under ZeRO-3: torch.no_grad)
        # Built on first use and kept: datasets indexed once, prompts/captions tokenized once, image
        # loaders whose worker processes stay alive between evaluations (every epoch's evaluation
        # otherwise pays the workers' start-up, more than encoding a small set costs).
        self._zs = None
        self._v2 = None
        self._val = None
        self._loaders: list[DataLoader] = []  # the kept ones, which close() shuts down

    @property
    def has_zeroshot(self) -> bool:
        return bool(self.cfg.zeroshot_data or self.cfg.imagenet_v2)

    @property
    def has_retrieval(self) -> bool:
        return bool(self.cfg.val_data)

    def _transform(self):

        return image_transform(self.image_size, is_train=False, **self.cfg.preprocess_args())

    def _loader(self, dataset) -> DataLoader:
        loader = eval_loader(dataset, batch_size=self.batch_size, workers=self.workers, persistent=True)
        self._loaders.append(loader)
        return loader

    def close(self) -> None:
        """Stop the kept loaders' worker processes (they ignore SIGTERM, so nothing else ends them) and forget
        the indexed sets; a later evaluation builds them again."""
        while self._loaders:
            shutdown_loader(self._loaders.pop())
        self._zs = self._v2 = self._val = None

    def zeroshot(self, model) -> dict[str, float]:
        out = self._folder_zeroshot(model) if self.cfg.zeroshot_data else {}
        if self.cfg.imagenet_v2:
            if self._v2 is None:
                self._v2 = ImageNetV2Dataset(self.cfg.imagenet_v2, self._transform())
            r = evaluate_zeroshot(
                model,
                self.tokenizer,
                self._v2,
                self._v2.labels,
                self._v2.classnames,
                load_templates(self.cfg.zeroshot_templates),
                batch_size=self.batch_size,
                device=self.device,
                workers=self.workers,
            )
            # OpenCLIP's names (open_clip_train/zero_shot.py)
            out.update({"imagenetv2-zeroshot-val-top1": r["top1"], "imagenetv2-zeroshot-val-top5": r["top5"]})
        return out

    def _folder_zeroshot(self, model) -> dict[str, float]:
        if self.cfg.zeroshot_data == "demo":
            r = evaluate_demo_zeroshot(
                model,
                self.tokenizer,
                image_size=self.image_size,
                num_samples=self.cfg.demo_eval_samples,
                batch_size=self.batch_size,
                device=self.device,
                templates=load_templates(self.cfg.zeroshot_templates) if self.cfg.zeroshot_templates else None,
                mean=self.cfg.image_mean,
                std=self.cfg.image_std,
                inference=self.inference,
            )
        else:
            if self._zs is None:
                ds = ClassFolderDataset(self.cfg.zeroshot_data, self._transform())
                templates = load_templates(self.cfg.zeroshot_templates)
                tokens = self.tokenizer(expand_prompts(ds.classnames, templates))
                self._zs = (ds, templates, self._loader(ds), tokens)
            ds, templates, loader, tokens = self._zs
            r = evaluate_zeroshot(
                model,
                self.tokenizer,
                ds,
                ds.labels,
                ds.classnames,
                templates,
                batch_size=self.batch_size,
                device=self.device,
                image_loader=loader,
                prompt_tokens=tokens,
                inference=self.inference,
            )
        return {"zeroshot-top1": r["top1"], "zeroshot-top5": r["top5"]}

    def retrieval(self, model) -> dict[str, float]:
        if not self.has_retrieval:
            return {}
        if self._val is None:
            ds, captions, t2i = load_retrieval_set(
                self.cfg.val_data,
                self._transform(),
                csv_img_key=self.cfg.csv_img_key,
                csv_caption_key=self.cfg.csv_caption_key,
                csv_separator=self.cfg.csv_separator,
                max_samples=self.cfg.val_num_samples,
                keys=self.cfg.sample_keys(),
            )
            self._val = (ds, captions, t2i, self._loader(ds), self.tokenizer(list(captions)))
        ds, captions, t2i, loader, tokens = self._val
        return evaluate_retrieval(
            model,
            self.tokenizer,
            ds,
            captions,
            t2i,
            batch_size=self.batch_size,
            device=self.device,
            image_loader=loader,
            caption_tokens=tokens,
            inference=self.inference,
        )


def append_results(path, record: dict) -> None:
    """Append one JSON line to ``path`` (results.jsonl) — on rank 0 only, so call it on every rank."""

    if rank_world()[0] != 0:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
