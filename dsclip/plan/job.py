"""One description of a training job, for everything that plans or rehearses it.

A :class:`Job` is what ``dsclip train`` would run: the model, the world, the batch and its split, the
precision, the DeepSpeed JSON (or just the ZeRO stage), the loss, activation checkpointing, patch dropout,
locking, the EMA. A setting left ``None`` is open: the search (dsclip.plan.search) chooses it. A
:class:`Cluster` is where it runs: the GPU (memory, peak), the node size, the host memory, the links.

Built once per caller and handed on, instead of each translating its own flags:

* ``dsclip plan`` (dsclip/cli/plan.py): from its command line;
* ``dsclip train --deepspeed-config auto`` (dsclip/train/auto_ds.py): :meth:`Job.from_sections`, the run
  config's own sections;
* ``dsclip plan --measure`` and the rehearsal (dsclip.rehearsal): :meth:`Job.chosen` (every dimension fixed
  to what the plan chose) rehearsed as it is, and :meth:`Job.sections` back to the run config's sections.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dsclip.engine.ds_config import TrainArgs, load_ds_json, run_precision
from dsclip.engine.ema_config import EmaArgs
from dsclip.losses.config import LOSS_FLAGS, TRAIN_TILE_SIZE, LossArgs
from dsclip.model.factory import ModelArgs
from dsclip.model.lock import LockConfig
from dsclip.plan import search as searching  # the module: bench/plan_choices.py spies on its search
from dsclip.plan.comm import LinkModel
from dsclip.plan.efficiency import H200_MEASURED_TFLOPS
from dsclip.plan.memory import offload_of
from dsclip.plan.planner import Plan, make_plan, shipped_ds_config
from dsclip.plan.search import Search

AUTO = "auto"  # train's --deepspeed-config auto: the JSON is open


@dataclass
class Cluster:
    """Where a job runs. ``mfu``: a given model-FLOPs utilisation (None: the measured rows', dsclip.plan.efficiency)."""

    gpu_memory_gb: float
    peak_tflops: float = H200_MEASURED_TFLOPS
    gpus_per_node: int = 8
    host_memory_gb: float = 1024.0
    reserve_gb: float = 2.0  # per GPU, kept for the CUDA context and the allocator
    link: LinkModel | None = None  # None: NVLink inside a node, InfiniBand between (dsclip.plan.comm's defaults)
    gpu: str = ""  # the GPU's name (--gpu), "" where only its memory is known
    mfu: float | None = None
    device: str = "cuda"  # "cpu": the ranks of a CPU run (--device cpu), RAM per rank as gpu_memory_gb
    baseline_gb: float | None = None  # --device cpu: a rank's measured resident size before the model exists

    def nodes(self, gpus: int) -> int:
        return math.ceil(gpus / self.gpus_per_node)

    def links(self) -> LinkModel:
        return self.link or LinkModel(gpus_per_node=self.gpus_per_node)


@dataclass
class Job:
    """One training job; ``None``: open, the search chooses (zero, ds_config, loss, grad_checkpointing,
    micro_batch). ``batch_size`` is the global contrastive batch per optimizer step; ``micro_batch`` the
    per-GPU micro-batch (``accum_freq`` follows)."""

    model: str | dict  # a registered name, a JSON path, or the resolved config dict (train's, auto)
    gpus: int  # the world
    batch_size: int | None  # global rows per optimizer step (None: --max-batch, not chosen yet)
    micro_batch: int | None = None
    precision: str = "bf16"  # bf16 | fp16 | fp32 (run_precision's); "auto" until a JSON decides it
    zero: int | None = None
    ds_config: tuple[str, dict] | None = None  # (name as given, JSON): fixes the stage and the offload
    loss: str | None = None
    tile: int = TRAIN_TILE_SIZE  # --loss-tile-size
    grad_checkpointing: bool | None = None
    patch_dropout: float = 0.0
    image_size: int | None = None  # --force-image-size (a config dict model has it applied already)
    lock: LockConfig | None = None
    ema_decay: float | None = None
    keep_last_graph: bool = True
    grad_reduction: str = "auto"  # --grad-reduction: auto plans both under ZeRO-2/3 (dsclip/engine/grad_reduction.py)

    @property
    def accum_freq(self) -> int | None:
        if not self.micro_batch or not self.batch_size:
            return None
        return self.batch_size // (self.gpus * self.micro_batch)

    @property
    def offload(self) -> str | None:
        return None if self.ds_config is None else offload_of(self.ds_config[1])

    def fixed(self) -> dict:
        """What the job fixes, as dsclip.plan.search takes it."""
        out: dict = {}
        if self.ds_config is not None:
            out["ds_config"] = self.ds_config
        elif self.zero is not None:
            out["zero"] = self.zero
        for key in ("loss", "grad_checkpointing", "micro_batch"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def plan_keywords(self, cluster: Cluster) -> dict:
        """:func:`dsclip.plan.planner.make_plan`'s keywords for what the search never changes."""
        return dict(
            gpus=self.gpus, gpu_memory_gb=cluster.gpu_memory_gb, batch_size=self.batch_size,
            patch_dropout=self.patch_dropout, mfu=cluster.mfu, peak_tflops=cluster.peak_tflops, tile=self.tile,
            gpus_per_node=cluster.gpus_per_node, reserve_gb=cluster.reserve_gb, image_size=self.image_size,
            lock=self.lock, host_memory_gb=cluster.host_memory_gb, link=cluster.links(),
            ema=self.ema_decay is not None, keep_last_graph=self.keep_last_graph, grad_reduction=self.grad_reduction,
        )  # fmt: skip

    def chosen(self, plan: Plan, ds_config: tuple[str, dict]) -> Job:
        """This job with every open setting fixed to what ``plan`` chose (``ds_config``: its JSON)."""
        return dataclasses.replace(
            self, batch_size=plan.batch_size, micro_batch=plan.micro_batch or self.micro_batch, zero=plan.zero,
            ds_config=ds_config, loss=plan.loss, grad_checkpointing=plan.grad_checkpointing, precision=plan.precision,
            grad_reduction=plan.grad_reduction,
        )  # fmt: skip

    @classmethod
    def from_sections(
        cls,
        *,
        model: ModelArgs,
        train: TrainArgs,
        loss: LossArgs,
        lock: LockConfig,
        ema: EmaArgs,
        world: int,
        model_cfg: dict | None = None,
    ) -> Job:
        """The job a run config describes on ``world`` ranks: its sections (dsclip.config.RunConfig's), and
        ``model_cfg`` the architecture as the run builds it (--force-image-size, patch dropout applied). The
        run's micro-batch, loss and checkpointing are fixed (they are the training, not the engine);
        ``--deepspeed-config auto`` leaves the stage and offload open, any other name or path fixes them."""
        ds = None
        if train.deepspeed_config != AUTO:
            ds = (train.deepspeed_config, load_ds_json(train.deepspeed_config))
        dropout = model.force_patch_dropout
        if dropout is None and model_cfg is not None:
            dropout = model_cfg.get("vision_cfg", {}).get("patch_dropout")
        return cls(
            model=model_cfg if model_cfg is not None else model.model,
            gpus=world,
            batch_size=train.batch_size * train.accum_freq * world,
            micro_batch=train.batch_size,
            precision=run_precision(train.precision, ds[1] if ds else None),
            ds_config=ds,
            loss=loss.name,
            tile=loss.loss_tile_size,
            grad_checkpointing=bool(model.grad_checkpointing),
            patch_dropout=dropout or 0.0,
            lock=lock if any(dataclasses.asdict(lock).values()) else None,
            ema_decay=ema.ema_decay,
            keep_last_graph=train.keep_last_graph,
            grad_reduction=train.grad_reduction,
        )

    def sections(self, **train_overrides) -> dict:
        """The run config's sections (model, loss, train, lock, ema) that run this job's chosen configuration:
        the inverse of :meth:`from_sections` (the rehearsal builds ``dsclip train``'s engine from them).
        ``train_overrides``: other TrainArgs fields (the rehearsal's JSON path, steps, seed)."""
        if not isinstance(self.model, str):
            raise ValueError("a job of a config dict has no --model name to run")
        flags = {f[2:].replace("-", "_"): True for f in LOSS_FLAGS[self.loss or "infonce"]}
        train = dict(
            batch_size=self.micro_batch,
            accum_freq=self.accum_freq or 1,
            precision=self.precision,
            grad_reduction=self.grad_reduction,
        )
        if self.ds_config is not None:
            train["deepspeed_config"] = self.ds_config[0]
        return {
            "model": ModelArgs(
                model=self.model,
                grad_checkpointing=bool(self.grad_checkpointing),
                force_patch_dropout=self.patch_dropout or None,
            ),
            "loss": LossArgs(**flags, loss_tile_size=self.tile),
            "train": TrainArgs(**{**train, "keep_last_graph": self.keep_last_graph, **train_overrides}),
            "lock": self.lock or LockConfig(),
            "ema": EmaArgs(ema_decay=self.ema_decay),
        }

    def to_dict(self) -> dict:
        """JSON-ready (the rehearsal's child process reads it back with :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Job:
        d = dict(d)
        if d.get("ds_config") is not None:
            d["ds_config"] = tuple(d["ds_config"])
        if d.get("lock") is not None:
            d["lock"] = LockConfig(**d["lock"])
        return cls(**d)


def default_ds_config(job: Job) -> tuple[str, dict]:
    """The job's JSON, or the shipped one of its stage (ZeRO-2 where open) and precision."""
    if job.ds_config is not None:
        return job.ds_config
    return shipped_ds_config(job.zero or 2, job.precision)


def plan_job(job: Job, cluster: Cluster, flags: dict | None = None) -> Search:
    """Every configuration ``job`` leaves open, planned on ``cluster`` and ranked (dsclip.plan.search);
    ``flags``: setting -> the flag that fixed it, for the output."""
    fixed = {**job.fixed(), "flags": dict(flags or {})}
    return searching.search(job.model, fixed=fixed, precision=job.precision, **job.plan_keywords(cluster))


def plan_configuration(job: Job, cluster: Cluster) -> Plan:
    """One configuration, nothing searched: the job's settings, an open one at its default (ZeRO-2 or the
    JSON's stage, the global InfoNCE, no checkpointing)."""
    name, cfg = default_ds_config(job)
    zero = int(cfg.get("zero_optimization", {}).get("stage", job.zero or 2))
    keywords = job.plan_keywords(cluster)
    return make_plan(
        job.model, **keywords, zero=zero, precision=job.precision, grad_checkpointing=bool(job.grad_checkpointing),
        loss=job.loss or "infonce", micro_batch=job.micro_batch, device=cluster.device,
        baseline_gb=cluster.baseline_gb, ds_config=(name, cfg),
    )  # fmt: skip
