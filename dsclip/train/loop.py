"""The training loop: config -> data/model -> engine -> steps -> logs/checkpoints.

Each component owns its cadence (the checkpointer decides when to save, the metrics logger when to
print), so this file stays a readable sequence of what happens; :func:`build_run` is the composition
root (the builders it calls live in dsclip.train.build).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsclip.checkpoint import remote_resume, remote_sync, resume_optim, run_folder, run_lock
from dsclip.checkpoint.async_save import install_checkpoint_engine
from dsclip.checkpoint.ds_checkpoint import Checkpointer, record_tokenizer, tag_for_step
from dsclip.config import RunConfig, settle_run_name, validate
from dsclip.config_base import ConfigError
from dsclip.data import TrainData
from dsclip.dist import barrier, from_rank0
from dsclip.engine.build import build_engine, device_type
from dsclip.engine.optim import PARAM_ORDER
from dsclip.engine.world import cores, process_group, stop, watchdog
from dsclip.train import auto_ds, ema_step, finetune, runlog, wandb_sink
from dsclip.train.build import (
    StepPlan,
    announce,
    build_data,
    build_ds_config,
    build_evaluator,
    build_step,
    cache_dir,
    check_torchcompile,
    merge_ds_config,
    model_factory,
    one_rank_zero3_note,
    record_engine_patches,
    resolved_model_config,
    write_run_files,
)
from dsclip.train.divergence import DivergenceGuard, HealthRule, loaded_scale, resumed_problem
from dsclip.train.evaluation import TrainingEvaluator
from dsclip.train.goodput import Goodput, summary_text
from dsclip.train.gradcache import GradCacheStep
from dsclip.train.hang import HangGuard
from dsclip.train.metrics import MetricsLogger, console, data_counters
from dsclip.train.progress import summary_line
from dsclip.train.teacher import plan_teacher

if TYPE_CHECKING:  # annotation only: importing deepspeed here would load it for every user of step_seed
    from deepspeed import DeepSpeedEngine

__all__ = ["Run", "build_run", "cache_dir", "fit", "step_seed", "train"]

log = logging.getLogger("dsclip")


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG seed of optimizer step ``step`` on ``rank``: dropout and patch-dropout masks depend only on
    (seed, step, rank), so a resumed run draws exactly the masks the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 9_176 + rank * 7_919) % (2**63 - 1)


@dataclass
class Run:
    """Everything one training run is made of, built once by :func:`build_run`."""

    cfg: RunConfig
    rank: int
    world_size: int
    engine: DeepSpeedEngine
    data: TrainData
    step_fn: GradCacheStep
    checkpointer: Checkpointer
    metrics: MetricsLogger
    evaluator: TrainingEvaluator
    plan: StepPlan
    start_step: int = 0
    guard: DivergenceGuard = field(default_factory=lambda: DivergenceGuard(0))
    last_loss: float = float("nan")  # of the last optimizer step (recorded with a checkpoint)
    step: int = 0  # the last optimizer step done (what a lost rank's line names)
    hang: HangGuard | None = None  # the hang bounds of fit() (dsclip.train.hang)
    goodput: Goodput = field(default_factory=Goodput)  # wall time by kind (dsclip.train.goodput)
    remote: remote_sync.RemoteSync | None = None  # --remote-sync's background sync (rank 0)

    def client_state(self, step: int) -> dict:
        """What a checkpoint records besides DeepSpeed's state: the data position and batch geometry, the
        optimizer settings (a resume with other ones says so and applies them: resume_optim) and the loss."""
        epoch, in_epoch = divmod(step, self.plan.steps_per_epoch)
        t = self.cfg.train
        finite = math.isfinite(self.last_loss)
        return {
            "optim": resume_optim.recorded(self.cfg.optim, self.plan.total_steps),
            "loss": self.last_loss if finite else None,
            "loss_finite": finite,
            "step": step,
            "epoch": epoch,
            "step_in_epoch": in_epoch,
            "samples_seen": step * self.plan.samples_per_step,
            "world_size": self.world_size,
            "param_order": PARAM_ORDER,
            "accum_freq": t.accum_freq,
            "batch_size": t.batch_size,
            "seed": t.seed,
        }


def train(cfg: RunConfig, *, started: float | None = None) -> dict:
    """Train per ``cfg`` on this rank; every rank of the job calls it. Returns a summary dict. ``started``:
    when this process started (perf_counter's scale; `dsclip train` passes it), where the goodput clock begins."""
    clock = Goodput(start=started)
    try:
        return _train(cfg, clock)
    finally:  # a process that trains again (tests, notebooks) must not hold the folder it left
        clock.save()  # whatever ended it: this start's seconds are kept (rank 0)
        run_lock.release_all()


def _train(cfg: RunConfig, clock: Goodput | None = None) -> dict:
    clock = clock or Goodput()
    # The run's lifetime: everything build_run opens (data and evaluation loaders, whose workers ignore SIGTERM;
    # the metrics sinks; the remote sync, whose last sync is waited for and reported) is closed here in reverse
    # order on every way out (the end, a stop, divergence, a lost rank, an exception), never left to garbage
    # collection: a loader still open at interpreter exit makes Python's exit handler join its workers forever
    # (DEEPSPEED-NOTES, "The run around the step").
    with contextlib.ExitStack() as closing:
        run = build_run(cfg, closing, clock=clock)
        try:
            return _train_run(run, run.goodput.start)
        except RuntimeError as e:  # another rank died: one line on the survivors, the traceback with --debug
            why = process_group.peer_lost(e)
            if why is None:
                raise
            raise rank_lost(run, why) from e


class RankLostError(ConfigError):
    """Another rank of the job is gone (killed, crashed): one line on the survivors."""


def rank_lost(run: Run, why: str) -> RankLostError:
    saving, latest = run.checkpointer.incomplete_step(), latest_tag(run)
    during = f"in the save of checkpoint {tag_for_step(saving)} (incomplete, never used)" if saving else (
        f"during step {run.step + 1}"
    )  # fmt: skip
    kept = f"latest names {latest}" if latest else "no checkpoint was saved yet"
    way = "continue with --resume latest" + ("" if latest else " (from step 0: nothing to resume yet)")
    error = RankLostError(
        f"{process_group.lost_peer_name(run.rank, run.world_size)} stopped {during}, after step {run.step} ({why}); "
        f"{kept}; {way} (its own log or the launcher's output says why it stopped; the traceback: --debug)"
    )
    log.error(str(error))
    return error


def _train_run(run: Run, t_start: float) -> dict:
    cfg = run.cfg  # with the run name decided
    step, preempted = fit(run)
    run.goodput.set_base("stop" if preempted else "other")  # the wind-down of a stop is the stop's cost
    if run.guard.ended_unhealthy:  # the last steps were unhealthy: nothing from them is saved or kept as good
        raise stop_diverged(run, step, at_end=True)
    if run.checkpointer.last_saved_step != step and (
        preempted or cfg.checkpoint.save_frequency or cfg.checkpoint.save_every_n_steps
    ):
        save_if_good(run, step)
    finish_writes(run, why=f"{'a stop signal' if preempted else 'the end of the run'}: latest moves once it completes")
    if not preempted and run.guard.good_to_save:
        # a finished run: no later step will vouch for the final weights (--lr 1e6 blows them up in the last
        # step with a finite loss), so they are judged by the rule's bound on their logit scale; only then is
        # the checkpoint --keep-last kept back for safety (Checkpointer.certify) released
        why = resumed_problem(run.guard.rule, loaded_scale(run.engine))
        if why:
            run.guard.final_weights_bad(step, why, run.last_loss)
            raise stop_diverged(run, step, at_end=True)
        run.checkpointer.certify(step)
    summary = {"step": step, "run_dir": str(cfg.run_dir), "preempted": bool(preempted)}
    # the last checkpoint is safe: say how this start ends before any rank can exit (the barrier), so a
    # batch script whose srun reports a sibling's 143 still learns that dsclip asked for a requeue
    if run.rank == 0:
        write_exit_status(run, step, preempted)
    barrier()
    if preempted:
        # the checkpoint (or, after a bad step, the last good one) and exit_status.json are settled on every
        # rank: a second SIGTERM from here on ends this rank with the stop's code, not by the signal
        stop.stop_saved(stop.exit_code(preempted))
    # whatever ended training (the last epoch, --max-steps, the end of the data, a preemption, after its
    # checkpoint is safe): the configured evaluations run once more unless they just ran (collective)
    with run.goodput.span("eval"):
        summary.update(run.evaluator.final(run.engine, step, max(step - 1, 0) // run.plan.steps_per_epoch))
    if run.rank == 0:
        report = write_exit_status(run, step, preempted)  # again: the goodput up to the end line
        run.metrics.log_goodput(step, report)
        console(final_summary(run, step, time.perf_counter() - t_start, preempted=bool(preempted), report=report))
    if preempted and run.rank == 0:
        what = "to requeue (SIGUSR1)" if preempted == stop.STOP_REQUEUE else "(SIGTERM: not requeued)"
        console(f"preempted: checkpoint saved at step {step}; exiting with {stop.exit_code(preempted)} {what}")
    summary["exit_code"] = stop.exit_code(preempted)
    return summary


def write_exit_status(run: Run, step: int, preempted: str | None) -> dict:
    """Rank 0: RUN/exit_status.json for a start that ends at ``step`` (``preempted``: the stop's reason), with
    the run's goodput so far; returns that goodput report."""
    report = run.goodput.report()
    runlog.write_exit_status(
        run.cfg.run_dir, exit_code=stop.exit_code(preempted), stop=preempted, step=step, checkpoint=latest_tag(run),
        goodput=report,
    )  # fmt: skip
    return report


def stop_diverged(run: Run, step: int, *, at_end: bool = False) -> Exception:
    """The run diverged at ``step``: unconfirmed tags marked, ``latest`` on the last good one, exit_status.json
    saying so (not the status of the start it resumed from), the error logged; returns the error to raise."""
    run.goodput.set_base("stop")
    good = run.checkpointer.mark_diverged(step, run.guard.first_bad)
    error = run.guard.error(step, good, at_end=at_end)
    if run.rank == 0:
        runlog.write_exit_status(
            run.cfg.run_dir, exit_code=2, stop="diverged", step=step, checkpoint=None if good is None else str(good),
            goodput=run.goodput.report(),
        )  # fmt: skip
    log.error(str(error))  # into RUN/out.log; the console gets it as the run's error line
    return error


def save_if_good(run: Run, step: int, *, epoch_end: bool | None = None, epoch: int = 0) -> bool:
    """:func:`save_checkpoint`, unless the last step was skipped or its loss not finite (dsclip.train.divergence):
    then a save that was due is one line, and ``latest`` stays where it is."""
    if run.guard.good_to_save:
        return save_checkpoint(run, step, epoch_end=epoch_end, epoch=epoch)
    if epoch_end is None or run.checkpointer.due(step, epoch_end=epoch_end, epoch=epoch):
        run.metrics.write_line(run.guard.not_saved_line(step, latest_tag(run)))
    return False


def latest_tag(run: Run) -> str | None:
    pointer = run.checkpointer.dir / "latest"
    return str(run.checkpointer.dir / pointer.read_text().strip()) if pointer.is_file() else None


def save_checkpoint(run: Run, step: int, *, epoch_end: bool | None = None, epoch: int = 0) -> bool:
    """Save at ``step`` (``epoch_end`` given: only if the checkpointer's cadence says so); rank 0 prints
    where and how long it took, and that time is left out of the training throughput (collective)."""
    ckpt = run.checkpointer
    if epoch_end is not None and (ckpt.last_saved_step == step or not ckpt.due(step, epoch_end=epoch_end, epoch=epoch)):
        return False
    t0 = time.perf_counter()
    # the long collective timeout (saves take minutes); the whole synchronous save is this start's save stall
    with slow(run, f"save of checkpoint {tag_for_step(step)}"), run.goodput.span("save"):
        if epoch_end is None:
            ckpt.save(run.engine, step, run.client_state(step))
        else:
            ckpt.maybe_save(run.engine, step, run.client_state(step), epoch_end=epoch_end, epoch=epoch)
    seconds = time.perf_counter() - t0
    if run.rank == 0:
        run.goodput.save()  # a start killed from here on keeps its seconds up to this checkpoint
    run.metrics.exclude(seconds)
    how = "; copied to host memory, written in the background" if ckpt.in_flight is not None else ""
    run.metrics.write_line(f"checkpoint saved: {checkpoint_path(run, step)} (step {step}, {seconds:.1f} s{how})")
    return True


def complete_writes(run: Run, flags) -> None:
    """After a step: the background write of a save done on every rank -> its tag completed (collective; the
    step's summed flags say it, so every rank decides alike). Its seconds are left out of the throughput."""
    ckpt = run.checkpointer
    if ckpt.in_flight is None:
        return
    t0, times = time.perf_counter(), ckpt.in_flight.times
    with slow(run, f"completion of checkpoint {times.tag}"), run.goodput.span("save"):
        if not ckpt.after_step(flags):
            return
    run.metrics.exclude(time.perf_counter() - t0)
    run.goodput.add("background_write", times.write_s)  # beside the steps: reported apart, not in the 100 %
    run.metrics.write_line(
        f"checkpoint complete: {ckpt.dir / times.tag} (step {times.step}, written in the background in "
        f"{times.write_s:.1f} s; latest names it)"
    )


def finish_writes(run: Run, why: str) -> None:
    """Wait for the background write in flight (one line saying so) and complete its tag (collective)."""
    if run.checkpointer.in_flight is None:
        return
    t0, times = time.perf_counter(), run.checkpointer.in_flight.times
    with slow(run, "the background checkpoint write"), run.goodput.span("save"):  # the wait is a save stall
        run.checkpointer.drain(why)
    run.goodput.add("background_write", times.write_s)
    run.metrics.exclude(time.perf_counter() - t0)


def checkpoint_path(run: Run, step: int) -> Path:
    return run.checkpointer.dir / tag_for_step(step)


def final_summary(run: Run, step: int, wall_s: float, *, preempted: bool, report: dict | None = None) -> str:
    """The run's last line: steps, wall time (set-up included), training samples/s, the last checkpoint,
    the last evaluation's headline metric and the run's goodput (dsclip.train.goodput.summary_text)."""
    steps_run = run.metrics.steps_here
    train_s = run.metrics.train_seconds()
    saved = run.checkpointer.last_saved_step
    return summary_line(
        step=step,
        steps_run=steps_run,
        wall_s=wall_s,
        samples_per_s=steps_run * run.plan.samples_per_step / train_s if train_s > 0 else 0.0,
        checkpoint=None if saved is None else str(checkpoint_path(run, saved)),
        evaluation=run.evaluator.headline(),
        preempted=preempted,
        goodput=None if report is None else summary_text(report),
    )


def slow(run: Run, what: str):
    """The long timeouts for a save or an evaluation while the hang bounds are armed (dsclip.train.hang)."""
    return run.hang.slow(what) if run.hang is not None else contextlib.nullcontext()


def fit(run: Run) -> tuple[int, str | None]:
    """Optimizer steps from ``run.start_step`` to ``run.plan.total_steps`` (or a stop signal), under the hang
    bounds from the third step on: a rank that stops answering ends the job with one line per rank."""
    cfg = run.cfg
    run.hang = HangGuard(
        cfg.train, rank=run.rank, world_size=run.world_size, run_dir=cfg.run_dir, name=cfg.log.name,
        latest=lambda: latest_tag(run), start_step=run.start_step, goodput=run.goodput,
    )  # fmt: skip
    try:
        return _steps(run)
    except RuntimeError as e:
        if why := process_group.collective_timed_out(e):
            run.hang.collective_timed_out(why)  # one line, exit 2: never returns
        raise
    finally:
        run.hang.close()


def _steps(run: Run) -> tuple[int, str | None]:
    cfg, engine, k = run.cfg, run.engine, run.cfg.train.accum_freq
    step, preempted = run.start_step, False
    run.step = step
    epoch, in_epoch = divmod(step, run.plan.steps_per_epoch)
    while step < run.plan.total_steps and not preempted:
        batches = run.data.batches(epoch, start_step=in_epoch * k)
        chunk: list = []
        t_wait = time.perf_counter()
        for batch in batches:
            chunk.append(batch)
            if len(chunk) < k:
                continue
            data_wait = time.perf_counter() - t_wait
            # this start's first batch ends its start-up (loader workers, first shards); later ones are input waits
            if step > run.start_step:
                run.goodput.tick("data_wait")
            else:
                run.goodput.tick("startup")
                run.goodput.set_base("other")
            torch.manual_seed(step_seed(cfg.train.seed, step, run.rank))
            engine.train()
            result = run.step_fn(chunk, grad_norm=run.metrics.logs_step(step + 1))
            chunk = []
            step, in_epoch = step + 1, in_epoch + 1
            run.step = step
            epoch_end = in_epoch == run.plan.steps_per_epoch
            run.metrics.step(
                step,
                result,
                data_wait_s=data_wait,
                lr=engine.get_lr()[0],
                epoch=epoch,
                extra={**data_counters(run.data.stats()), **result.terms},  # + contrastive/distill_loss
            )
            run.last_loss = result.loss
            run.hang.step_done(step)
            run.goodput.tick("step")
            if run.guard.observe(step, result):
                run.checkpointer.certify(step - 1)  # the weights this step trained on were good
            if run.guard.diverged:  # before any save: nothing from the diverged state reaches the disk
                raise stop_diverged(run, step)
            complete_writes(run, result.flags)  # the previous save's tag, once every rank wrote its files
            save_if_good(run, step, epoch_end=epoch_end, epoch=epoch)
            if epoch_end:
                with slow(run, "evaluation"), run.goodput.span("eval"):
                    run.evaluator.epoch_end(engine, step, epoch)
            # the stop flags were summed over all ranks inside the step: every rank stops at the same step
            preempted = stop.stop_reason(result.flags)
            if step >= run.plan.total_steps or epoch_end or preempted:
                break
            t_wait = time.perf_counter()
        batches.close()
        if in_epoch == run.plan.steps_per_epoch:
            epoch, in_epoch = epoch + 1, 0
    return step, preempted


def take_run_lock(run_dir, rank: int, ckpt=None) -> None:
    """Rank 0 takes the run folder's lock (held until the process ends) and, with ``ckpt`` (the checkpoint
    section), refuses to start a new run over one that holds checkpoints (dsclip.checkpoint.run_folder);
    every rank raises its refusal, so no rank of a second job goes on to write (collective)."""
    error = None
    if rank == 0:
        try:
            run_lock.acquire(run_dir)
            if ckpt is not None:
                run_folder.check_new_run(run_dir, resume=ckpt.resume, overwrite=ckpt.overwrite, say=console)
        except ConfigError as e:
            error = str(e)
    error = from_rank0(error)
    if error:
        raise ConfigError(error)


def build_run(cfg: RunConfig, closing: contextlib.ExitStack, clock: Goodput | None = None) -> Run:
    """The composition root: config -> world -> data/model -> engine -> step, checkpointer, metrics, evaluator.
    What it opens is registered on ``closing`` as soon as it exists, so a failure later in the build closes it.
    ``clock``: the start's goodput ledger (its start-up is ticking; the resume's reading and loading are spans)."""
    clock = clock or Goodput()
    info, cfg, ft, model_cfg = _start(cfg)
    rank, world_size = info.rank, info.world_size
    if rank == 0:
        clock.attach(cfg.run_dir)  # holding the run lock: RUN/goodput/ belongs to this run
    ds_config = build_ds_config(cfg.train, cfg.optim, world_size)
    checkpointer = Checkpointer.from_args(cfg.checkpoint, cfg.run_dir, rank=rank)
    with clock.span("resume"):  # --resume: the checkpoint found (locally, or the newest remote one) and verified
        remote = open_remote(cfg, rank, closing)  # before --resume latest is resolved: it may take a remote one
        resume_ds = checkpointer.prepare_resume(cfg.checkpoint.resume, world_size=world_size)
    ds_config = merge_ds_config(ds_config, resume_ds)
    tokenizer, data = build_data(cfg.data, model_cfg, cfg.model, cfg.train, rank=rank, world_size=world_size)
    closing.callback(data.close)
    student_cfg = resolved_model_config(cfg.model, cfg.loss, model_cfg, tokenizer)
    ft.check_weights(student_cfg)  # before any engine
    checkpointer.check_model(student_cfg, cfg.model.model)  # --resume: the same architecture, before any write
    teacher_plan = plan_teacher(cfg.loss, cfg.model, tokenizer, student_cfg)  # --distill-model: checked, not loaded
    if rank == 0:
        _write_run_files(cfg, ds_config, tokenizer, world_size)
    plan = StepPlan.of(cfg.train, data, world_size)
    bundle = build_engine(
        ds_config, cfg.train, cfg.optim, model_factory(cfg.model, cfg.loss, model_cfg, tokenizer, seed=cfg.train.seed),
        total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
        grad_checkpointing=cfg.model.grad_checkpointing, after_construction=ft.after_construction,  # weights, locking
    )  # fmt: skip
    if rank == 0:
        record_engine_patches(cfg.run_dir, bundle)  # what the rank lines say, kept with the run
    teacher = teacher_plan.build(ds_config) if teacher_plan else None  # outside the student's engine
    step_fn = build_step(bundle, cfg.loss, cfg.train, teacher, save_busy=checkpointer.write_busy)
    device = bundle.engine.device
    data.set_device(device, step_fn.compute_dtype)  # uint8 input is normalised there (dsclip.data.device_transform)
    metrics = MetricsLogger.from_args(
        cfg.log, cfg.run_dir, rank=rank, world_size=world_size, plan=plan, device=device,
        wandb=wandb_sink.for_run(cfg, rank), context_length=tokenizer.context_length,
    )  # fmt: skip
    closing.callback(metrics.close)
    evaluator = build_evaluator(cfg.log, cfg.data, tokenizer, model_cfg, metrics, run_dir=cfg.run_dir, device=device)
    closing.callback(evaluator.close)
    step_fn = ema_step.attach(cfg.ema, bundle.engine, step_fn, checkpointer)  # --ema-decay: before resume loads it
    install_checkpoint_engine(bundle.engine, checkpointer, bundle.precision, world_size)  # before resume loads
    closing.callback(checkpointer.close)  # a background write still in flight on an error: joined, not completed
    with clock.span("resume"):  # --resume: the checkpoint loaded
        start_step, guard = _resume(cfg, bundle, checkpointer, plan, step_fn, evaluator, metrics)
    if rank == 0:
        announce(cfg, bundle, plan, world_size, ft.summary(bundle.precision, bundle.zero_stage, world_size))
        if teacher is not None:
            console(f"dsclip: {teacher.describe()}")
    run = Run(
        cfg, rank, world_size, bundle.engine, data, step_fn, checkpointer, metrics, evaluator, plan, start_step, guard,
        goodput=clock, remote=remote,
    )  # fmt: skip
    if remote is not None:  # the thread starts last: a run that fails to build leaves none behind
        checkpointer.on_complete.append(remote.start().tag_complete)  # rank 0: uploaded in the background
    return run


def open_remote(cfg: RunConfig, rank: int, closing: contextlib.ExitStack) -> remote_sync.RemoteSync | None:
    """--remote-sync: rank 0 opens the run's remote folder (and for --resume latest with no local checkpoint
    downloads the newest remote one); its refusal is every rank's (collective). The sync (not started) is the
    first thing ``closing`` holds, so it closes last: its final sync sees every log closed. None on other ranks."""
    if cfg.remote.remote_sync is None:
        return None
    store = error = None
    if rank == 0:
        c = cfg.checkpoint
        try:
            store = remote_resume.prepare_run(
                cfg.remote, cfg.run_dir, str(cfg.log.name), resume=c.resume, overwrite=c.overwrite
            )
        except ConfigError as e:
            error = str(e)
    error = from_rank0(error)
    if error:
        raise ConfigError(error)
    if store is None:
        return None
    r = cfg.remote
    sync = remote_sync.RemoteSync(
        cfg.run_dir, store, frequency=r.remote_sync_frequency, keep_last=cfg.checkpoint.keep_last
    )
    closing.callback(remote_sync.close, sync)
    return sync


def _start(cfg: RunConfig):
    """The world and the settled run config (name, checks, run lock, logs, fine-tuning, `auto`), before any data."""
    # torch reads its flight-recorder variables when the process group is created: set the unset ones first
    backend = cfg.train.dist_backend or os.environ.get("DSCLIP_DIST_BACKEND")
    nccl = (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "nccl"
    watchdog.flight_recorder_env(cfg.log.logs, cfg.log.name, make_dir=nccl)
    info = process_group.init_distributed(backend=cfg.train.dist_backend, init_method=cfg.train.dist_url)
    stop.install_preemption_handler()
    cfg = settle_run_name(cfg)  # the clock's default, decided on rank 0 (collective)
    validate(cfg)
    take_run_lock(cfg.run_dir, info.rank, cfg.checkpoint)  # before anything is written into the run folder
    runlog.setup(cfg.log, cfg.run_dir, info.rank)  # RUN/out.log from here: the console lines of the set-up too
    cores.check_workers(cfg.data.workers)
    ft = finetune.prepare(cfg, rank=info.rank)  # --pretrained by name, --force-image-size, locking, quick_gelu
    cfg, model_cfg = ft.cfg, ft.model_cfg  # + the pretrained weights' architecture name and tokenizer
    check_torchcompile(cfg.train, device_type())
    cfg = auto_ds.resolve(cfg, model_cfg, info.world_size, info.rank)  # --deepspeed-config auto: rank 0's choice
    return info, cfg, ft, model_cfg


def _write_run_files(cfg: RunConfig, ds_config: dict, tokenizer, world_size: int) -> None:
    """Rank 0, once every check has passed: the run's config files, its tokenizer, the codebase copy."""
    if note := one_rank_zero3_note(ds_config, world_size):
        console(note)
    write_run_files(cfg, ds_config)  # exactly what deepspeed.initialize receives
    record_tokenizer(cfg.run_dir, tokenizer)  # `dsclip convert` ships it with the weights
    if cfg.log.copy_codebase:  # after the checks: a refused run leaves no copy behind
        runlog.copy_codebase(cfg.run_dir, resuming=cfg.checkpoint.resume is not None)


def _resume(cfg: RunConfig, bundle, checkpointer, plan, step_fn, evaluator, metrics) -> tuple[int, DivergenceGuard]:
    """--resume loaded (weights, EMA, data position) and the divergence guard set up; a tag whose weights the
    guard's rule marks is refused (weights blown up by an unguarded run are not trained on)."""
    start_step = checkpointer.resume(
        bundle.engine, global_batch=plan.samples_per_step, steps_per_epoch=plan.steps_per_epoch,
        optim=resume_optim.recorded(cfg.optim, plan.total_steps),
    )  # fmt: skip
    if isinstance(step_fn, ema_step.EmaStep):
        step_fn.step = start_step
        ema_step.attach_eval(cfg.ema, step_fn, evaluator)
    c = cfg.checkpoint
    rule = HealthRule(c.divergence_window, c.divergence_k, c.divergence_min_scale, c.divergence_scale_step)
    guard = DivergenceGuard(c.max_skipped_steps, rule)
    if checkpointer.resume_point is not None:
        if why := resumed_problem(rule, loaded_scale(bundle.engine)):
            raise checkpointer.refuse_resumed(why)
        point = checkpointer.resume_point
        metrics.mark_resume(start_step, str(point.load_dir / point.tag))  # metrics.jsonl: re-run steps follow
    return start_step, guard
