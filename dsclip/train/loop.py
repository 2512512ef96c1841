"""The training loop: config -> data/model -> engine -> steps -> logs/checkpoints.

Each component owns its cadence (the checkpointer decides when to save, the metrics logger when to
print), so this file stays a readable sequence of what happens.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dsclip import config as cfgmod
from dsclip.checkpoint import ds_checkpoint, universal
from dsclip.config import ConfigError, RunConfig
from dsclip.data import build_tokenizer, build_train_data
from dsclip.engine import world
from dsclip.engine.build import autocast_dtype, build_engine, device_type
from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
from dsclip.losses import build_loss
from dsclip.model import create_model, get_model_config
from dsclip.train import runlog, wandb_sink
from dsclip.train.evaluation import TrainingEvaluator
from dsclip.train.gradcache import GradCacheStep
from dsclip.train.metrics import MetricsLogger, data_counters

log = logging.getLogger("dsclip")

SIGLIP_INIT_LOGIT_BIAS = -10.0  # OpenCLIP --siglip: scale init ln(10), bias -10


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed of optimizer step ``step`` on ``rank``: dropout and patch-dropout masks depend only on
    (seed, step, rank), so a resumed run draws exactly the masks the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 9_176 + rank * 7_919) % (2**63 - 1)


def cache_dir() -> Path:
    return Path(os.environ.get("DSCLIP_CACHE", Path.home() / ".cache" / "dsclip"))


@dataclass
class Run:
    """Everything one training run is made of, built once by :func:`build_run`."""

    cfg: RunConfig
    rank: int
    world_size: int
    engine: object
    zero_stage: int
    precision: str
    data: object  # dsclip.data.TrainData
    step_fn: GradCacheStep
    checkpointer: ds_checkpoint.Checkpointer
    metrics: MetricsLogger
    evaluator: TrainingEvaluator
    steps_per_epoch: int
    total_steps: int
    samples_per_step: int  # global: batch × accum_freq × world
    start_step: int = 0

    def client_state(self, step: int) -> dict:
        """What a checkpoint records besides DeepSpeed's state: the data position and batch geometry."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        t = self.cfg.train
        return {
            "step": step,
            "epoch": epoch,
            "step_in_epoch": in_epoch,
            "samples_seen": step * self.samples_per_step,
            "world_size": self.world_size,
            "accum_freq": t.accum_freq,
            "batch_size": t.batch_size,
            "seed": t.seed,
        }


def train(cfg: RunConfig) -> dict:
    """Train per ``cfg`` on this rank; every rank of the job calls it. Returns a summary dict."""
    run = build_run(cfg)
    step, preempted = fit(run)
    if run.checkpointer.last_saved_step != step and (
        preempted or cfg.checkpoint.save_frequency or cfg.checkpoint.save_every_n_steps
    ):
        run.checkpointer.save(run.engine, step, run.client_state(step))
    summary = {"step": step, "run_dir": str(cfg.run_dir), "preempted": preempted}
    if not preempted:
        summary.update(run.evaluator.final(run.engine, step, step // run.steps_per_epoch))
    run.metrics.close()
    run.data.close()
    if preempted and run.rank == 0:
        print(f"preempted: checkpoint saved at step {step}; exiting with {world.EXIT_REQUEUE} to requeue", flush=True)
    summary["exit_code"] = world.EXIT_REQUEUE if preempted else 0
    return summary


def fit(run: Run) -> tuple[int, bool]:
    """Optimizer steps from ``run.start_step`` to ``run.total_steps`` (or a preemption signal)."""
    cfg, engine, k = run.cfg, run.engine, run.cfg.train.accum_freq
    step, preempted = run.start_step, False
    epoch, in_epoch = divmod(step, run.steps_per_epoch)
    while step < run.total_steps and not preempted:
        batches = run.data.batches(epoch, start_step=in_epoch * k)
        chunk: list = []
        t_wait = time.perf_counter()
        for batch in batches:
            chunk.append(batch)
            if len(chunk) < k:
                continue
            data_wait = time.perf_counter() - t_wait
            torch.manual_seed(step_seed(cfg.train.seed, step, run.rank))
            engine.train()
            result = run.step_fn(chunk)
            chunk = []
            step, in_epoch = step + 1, in_epoch + 1
            epoch_end = in_epoch == run.steps_per_epoch
            run.metrics.step(
                step,
                result,
                data_wait_s=data_wait,
                lr=engine.get_lr()[0],
                epoch=epoch,
                extra=data_counters(run.data.stats()),
            )
            run.checkpointer.maybe_save(engine, step, run.client_state(step), epoch_end=epoch_end, epoch=epoch)
            if epoch_end:
                run.evaluator.epoch_end(engine, step, epoch)
            preempted = world.preemption_requested()  # collective: all ranks stop at the same step
            if step >= run.total_steps or epoch_end or preempted:
                break
            t_wait = time.perf_counter()
        batches.close()
        if in_epoch == run.steps_per_epoch:
            epoch, in_epoch = epoch + 1, 0
    return step, preempted


def build_run(cfg: RunConfig) -> Run:
    """config -> world -> data/model -> engine -> step, checkpointer, metrics, evaluator (+ resume)."""
    info = world.init_distributed()
    rank, world_size = info.rank, info.world_size
    world.install_preemption_handler()
    cfgmod.validate(cfg, world_size=world_size)
    run_dir = cfg.run_dir

    # --- config: everything checked before any expensive work ---
    model_cfg = get_model_config(cfg.model.model)
    if cfg.model.force_quick_gelu:  # kept in the model's config, so checkpoints and `dsclip convert` carry it
        model_cfg = {**model_cfg, "quick_gelu": True}
    ds_config = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg, world_size=world_size, device_type=device_type()
    )
    if cfg.train.torchcompile:
        from dsclip.engine.compile import CompileSetupError, check_compile_setup

        try:
            check_compile_setup(cfg.train.torchcompile_backend, device_type())
        except CompileSetupError as e:
            raise ConfigError(str(e)) from e
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfgmod.save_run_config(cfg, run_dir / "run_config.yaml")
        (run_dir / "ds_config.json").write_text(cfgmod.dumps(ds_config))
        if cfg.log.copy_codebase:
            runlog.copy_codebase(run_dir, resuming=cfg.checkpoint.resume is not None)
    runlog.setup(cfg.log, run_dir, rank)
    resume = ds_checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir) if cfg.checkpoint.resume else None
    if resume is not None and universal.needs_universal(universal.saved_state(*resume), world_size):
        # saved on another number of ranks: load a re-shardable (universal) copy of the tag
        resume = universal.prepare_universal(*resume, rank=rank)
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}

    # --- data and model ---
    context_length = cfg.model.context_length or model_cfg["text_cfg"].get("context_length", 77)
    image_size = model_cfg["vision_cfg"]["image_size"]
    try:  # the data layer reports unusable settings (no shards, no tokenizer, ...) as ValueError
        tokenizer = build_tokenizer(cfg.data, context_length, cache_dir())
        data = build_train_data(
            cfg.data,
            tokenizer=tokenizer,
            image_size=image_size,
            batch_size=cfg.train.batch_size,
            rank=rank,
            world_size=world_size,
            seed=cfg.train.seed,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if rank == 0:
        ds_checkpoint.record_tokenizer(run_dir, tokenizer)  # `dsclip convert` ships it with the weights
    k = cfg.train.accum_freq
    steps_per_epoch = data.steps_per_epoch // k
    if steps_per_epoch < 1:
        raise ConfigError(
            f"one optimizer step needs {k} micro-batches of {cfg.train.batch_size} per rank, but an epoch has only "
            f"{data.steps_per_epoch}; lower --accum-freq/--batch-size or add data"
        )
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)

    def model_factory():
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        return create_model(
            model_cfg,
            force_patch_dropout=cfg.model.force_patch_dropout,
            vocab_size=tokenizer.vocab_size,
            context_length=context_length,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            init_logit_bias=SIGLIP_INIT_LOGIT_BIAS if cfg.model.siglip else None,
        )

    def load_pretrained(model):
        from dsclip.checkpoint.pretrained import load_pretrained_into

        load_pretrained_into(model, cfg.model.pretrained)

    # --- engine and the components that own their cadence ---
    bundle = build_engine(
        cfg,
        ds_config,
        model_factory,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        after_construction=load_pretrained if cfg.model.pretrained else None,
    )
    engine = bundle.engine
    loss_fn = build_loss(cfg.loss_name, tile_size=cfg.loss.loss_tile_size, label_smoothing=cfg.loss.label_smoothing)
    samples_per_step = cfg.train.batch_size * k * world_size
    metrics = MetricsLogger(
        run_dir,
        rank=rank,
        world_size=world_size,
        every_n_steps=cfg.log.log_every_n_steps,
        report_to=cfg.log.report_to,
        samples_per_step=samples_per_step,
        total_steps=total_steps,
        device=engine.device,
        wandb=wandb_sink.for_run(cfg, rank),
        context_length=context_length,
    )
    run = Run(
        cfg=cfg,
        rank=rank,
        world_size=world_size,
        engine=engine,
        zero_stage=bundle.zero_stage,
        precision=bundle.precision,
        data=data,
        step_fn=GradCacheStep(
            engine, loss_fn, keep_last_graph=cfg.train.keep_last_graph, compute_dtype=autocast_dtype(bundle)
        ),
        checkpointer=ds_checkpoint.Checkpointer(
            run_dir,
            every_n_steps=cfg.checkpoint.save_every_n_steps,
            every_n_epochs=cfg.checkpoint.save_frequency,
            keep_last=cfg.checkpoint.keep_last,
            rank=rank,
            most_recent=cfg.checkpoint.save_most_recent,
        ),
        metrics=metrics,
        evaluator=TrainingEvaluator(
            cfg, tokenizer=tokenizer, image_size=image_size, device=engine.device, run_dir=run_dir, metrics=metrics
        ),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        samples_per_step=samples_per_step,
    )
    if resume is not None:
        state = ds_checkpoint.load(engine, *resume)
        # same global batch: same step; otherwise the same place in the data (rule in checkpoint/universal.py)
        run.start_step, moved = universal.resume_position(
            state, global_batch=samples_per_step, steps_per_epoch=steps_per_epoch
        )
        if moved:
            universal.set_schedule_step(engine, run.start_step)
        if rank == 0:
            print(f"resumed from {resume[0] / resume[1]} at step {run.start_step}", flush=True)
    if rank == 0:
        print(
            f"dsclip: {cfg.model.model} | world {world_size} | ZeRO-{bundle.zero_stage} {bundle.precision} | "
            f"loss {cfg.loss_name} | batch {cfg.train.batch_size} x accum {k} x world {world_size} = "
            f"{samples_per_step} | {steps_per_epoch} steps/epoch | {total_steps} steps | run {run_dir}",
            flush=True,
        )
    return run
