"""The builders :func:`dsclip.train.loop.build_run` composes: each takes its config section.

Everything here runs once per run, before the first step; nothing here runs per step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dsclip.config import ConfigError, RunConfig, dumps, save_run_config
from dsclip.data import DataConfig, TrainData, build_tokenizer, build_train_data
from dsclip.engine import layer_decay
from dsclip.engine.build import EngineBundle, autocast_dtype, device_type
from dsclip.engine.compile import CompileSetupError, check_compile_setup
from dsclip.engine.ds_config import TrainArgs, load_ds_json, resolve_ds_config
from dsclip.engine.optim import OptimArgs
from dsclip.engine.world import stop
from dsclip.losses import SIGLIP_INIT_LOGIT_BIAS, LossArgs, build_loss
from dsclip.model import ModelArgs, create_model
from dsclip.train.evaluation import TrainingEvaluator
from dsclip.train.gradcache import GradCacheStep
from dsclip.train.metrics import LogArgs, MetricsLogger, console
from dsclip.train.teacher import Teacher


def cache_dir() -> Path:
    return Path(os.environ.get("DSCLIP_CACHE", Path.home() / ".cache" / "dsclip"))


def check_torchcompile(train: TrainArgs, device_type: str) -> None:
    """--torchcompile: refuse a backend this machine cannot run before any expensive work."""
    if not train.torchcompile:
        return
    try:
        check_compile_setup(train.torchcompile_backend, device_type)
    except CompileSetupError as e:
        raise ConfigError(str(e)) from e


def build_ds_config(train: TrainArgs, optim: OptimArgs, world_size: int) -> dict:
    """The DeepSpeed JSON of --deepspeed-config with its "auto" values filled from the run settings."""
    return resolve_ds_config(
        load_ds_json(train.deepspeed_config), train, optim, world_size=world_size, device_type=device_type()
    )


def one_rank_zero3_note(ds_config: dict, world_size: int) -> str | None:
    """The start-up line for ZeRO-3 on one rank without offload: every partition is the whole model, so it holds
    what ZeRO-2 holds and only adds ZeRO-3's gathers and hooks (not an error: it runs)."""
    z = ds_config.get("zero_optimization", {})
    keys = ("offload_optimizer", "offload_param")
    offloaded = any((z.get(k) or {}).get("device", "none") not in ("none", None) for k in keys)
    if world_size != 1 or z.get("stage") != 3 or offloaded:
        return None
    on = [k for k in ("bf16", "fp16") if (ds_config.get(k) or {}).get("enabled") is True]
    zero2 = f"zero2_{on[0] if on else 'fp32'}"
    return (
        f"dsclip: ZeRO-3 on one rank without offload holds the memory ZeRO-2 holds (each partition is the whole "
        f"model) and runs slower (0.30-0.39x ZeRO-2's rate on one H200, docs/zero-and-precision.md): "
        f"--deepspeed-config {zero2} trains the same model faster"
    )


def merge_ds_config(ds_config: dict, changes: dict) -> dict:
    """``ds_config`` with each block of ``changes`` merged into the block of the same name."""
    return {**ds_config, **{key: {**ds_config.get(key, {}), **block} for key, block in changes.items()}}


def write_run_files(cfg: RunConfig, ds_config: dict) -> None:
    """Rank 0: the resolved run config and exactly the DeepSpeed config the engine is built from."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(cfg, cfg.run_dir / "run_config.yaml")
    (cfg.run_dir / "ds_config.json").write_text(dumps(ds_config))


def record_engine_patches(run_dir: Path, bundle: EngineBundle) -> None:
    """Rank 0: the engine patches active on this run, as a comment at the end of run_config.yaml (a comment,
    so the file still loads as a run config: ``engine_patches`` above it is the selection)."""
    from dsclip.engine.versions import deepspeed_version

    active = ", ".join(bundle.patches.active) if bundle.patches and bundle.patches.active else "none"
    with open(run_dir / "run_config.yaml", "a") as f:
        f.write(f"# engine patches active (rank 0, DeepSpeed {deepspeed_version()}): {active}\n")


def build_data(
    data: DataConfig, model_cfg: dict, model: ModelArgs, train: TrainArgs, *, rank: int, world_size: int
) -> tuple:
    """(tokenizer, this rank's TrainData); unusable data settings (no shards, no tokenizer...) are ConfigErrors."""
    context_length = model.context_length or model_cfg["text_cfg"].get("context_length", 77)
    try:  # the data layer reports unusable settings as ValueError
        tokenizer = build_tokenizer(data, context_length, cache_dir())
        train_data = build_train_data(
            data,
            tokenizer=tokenizer,
            image_size=model_cfg["vision_cfg"]["image_size"],
            batch_size=train.batch_size,
            rank=rank,
            world_size=world_size,
            seed=train.seed,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return tokenizer, train_data


@dataclass
class StepPlan:
    """How many optimizer steps a run makes, and how many samples each covers."""

    steps_per_epoch: int  # optimizer steps (each takes accum_freq micro-batches of the data)
    total_steps: int
    samples_per_step: int  # global: batch × accum_freq × world

    @classmethod
    def of(cls, train: TrainArgs, data: TrainData, world_size: int) -> StepPlan:
        k = train.accum_freq
        steps_per_epoch = data.steps_per_epoch // k
        if steps_per_epoch < 1:
            raise ConfigError(
                f"one optimizer step needs {k} micro-batches of {train.batch_size} per rank, but an epoch has only "
                f"{data.steps_per_epoch}; lower --accum-freq/--batch-size or add data"
            )
        total_steps = train.epochs * steps_per_epoch
        if train.max_steps is not None:
            total_steps = min(total_steps, train.max_steps)
        return cls(steps_per_epoch, total_steps, train.batch_size * k * world_size)


def model_kwargs(model: ModelArgs, loss: LossArgs, model_cfg: dict, tokenizer) -> dict:
    """``create_model`` overrides of this run: the tokenizer's vocabulary, context, SigLIP bias, patch dropout."""
    return dict(
        force_patch_dropout=model.force_patch_dropout,
        vocab_size=tokenizer.vocab_size,
        context_length=model.context_length or model_cfg["text_cfg"].get("context_length", 77),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        init_logit_bias=SIGLIP_INIT_LOGIT_BIAS if loss.siglip else None,  # OpenCLIP --siglip: bias -10
    )


def resolved_model_config(model: ModelArgs, loss: LossArgs, model_cfg: dict, tokenizer) -> dict:
    """The architecture this run builds (overrides applied), from a meta-device model: no memory, no init."""
    return create_model(model_cfg, device="meta", **model_kwargs(model, loss, model_cfg, tokenizer)).config


def model_factory(
    model: ModelArgs, loss: LossArgs, model_cfg: dict, tokenizer, *, seed: int
) -> Callable[[], nn.Module]:
    """What the engine calls (inside zero.Init under ZeRO-3) to build the model."""
    kwargs = model_kwargs(model, loss, model_cfg, tokenizer)

    def build() -> nn.Module:
        torch.manual_seed(seed)  # identical initial weights on every rank
        return create_model(model_cfg, **kwargs)

    return build


def build_step(
    bundle: EngineBundle, loss: LossArgs, train: TrainArgs, teacher: Teacher | None = None, save_busy=None
) -> GradCacheStep:
    """One optimizer step over accum_freq micro-batches, with the run's loss (and the distillation teacher,
    moved to the engine's device in the compute dtype: it only ever runs forward). ``save_busy``: this rank's
    background checkpoint write is running (1.0/0.0), summed with the stop flags (Checkpointer.after_step)."""
    loss_fn = build_loss(loss.loss_config())
    if teacher is not None:
        teacher = teacher.to(torch.device(bundle.engine.device), autocast_dtype(bundle))
    return GradCacheStep(
        bundle.engine,
        loss_fn,
        accum_freq=train.accum_freq,
        grad_reduction=bundle.grad_reduction,
        keep_last_graph=train.keep_last_graph,
        compute_dtype=autocast_dtype(bundle),
        # stop signals and the background save's progress ride on the step's own all-reduce
        extra_flags=stop.local_stop_flags if save_busy is None else lambda: (*stop.local_stop_flags(), save_busy()),
        teacher=teacher,
    )


def build_evaluator(
    log: LogArgs, data: DataConfig, tokenizer, model_cfg: dict, metrics: MetricsLogger, *, run_dir: Path, device
) -> TrainingEvaluator:
    image_size = model_cfg["vision_cfg"]["image_size"]
    return TrainingEvaluator(
        log, data, tokenizer=tokenizer, image_size=image_size, device=device, run_dir=run_dir, metrics=metrics
    )


def announce(cfg: RunConfig, bundle: EngineBundle, plan: StepPlan, world_size: int, trainable: str = "") -> None:
    """Rank 0's summary of what this run is (and, when given, its trainable-parameter line), on the console
    and in RUN/out.log."""
    t = cfg.train
    console(
        f"dsclip: {cfg.model.model} | world {world_size} | ZeRO-{bundle.zero_stage} {bundle.precision} | "
        f"loss {cfg.loss_name} | batch {t.batch_size} x accum {t.accum_freq} x world {world_size} = "
        f"{plan.samples_per_step} | {plan.steps_per_epoch} steps/epoch | {plan.total_steps} steps | run {cfg.run_dir}"
    )
    if trainable:
        console(f"dsclip: {trainable}")
    decay = layer_decay.describe(bundle.module, cfg.optim.lr, cfg.optim.image_layer_decay, cfg.optim.text_layer_decay)
    if decay:
        console(f"dsclip: {decay}")
