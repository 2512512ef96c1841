"""Training metrics: an honest console line, TensorBoard scalars and metrics.jsonl.

Honest means: throughput is averaged over the whole logging window (not the last step), reported
both globally and per rank; the loss is the full-batch loss (mean over ranks); the data-wait
fraction says how much of the window the step waited for the loader. Only rank 0 writes.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from dsclip.config_base import ConfigError, opt
from dsclip.console import LOGGER, say
from dsclip.dist import initialized

# torch (and the tokenizer module, which loads it) are imported where used: LogArgs is a run-config section,
# and the run config's parser (`dsclip train --help`, the checks before the process group) runs without
# torch (issue #33).
if TYPE_CHECKING:
    import torch
from dsclip.train.progress import epoch_progress, eta_seconds, timing_text

REPORTERS = ("tensorboard", "wandb", "all")  # all: tensorboard and wandb, as OpenCLIP

# Console lines also go to the run's log file (dsclip.console, train/runlog.py).
# TensorBoard/wandb names of the scalars OpenCLIP also logs (open_clip_train/train.py), so existing
# dashboards keep working; metrics.jsonl keeps dsclip's own keys.
OPENCLIP_TAGS = {
    "logit_scale": "scale",
    "samples_per_s": "samples_per_second",
    "samples_per_s_per_rank": "samples_per_second_per_gpu",
    "step_time_s": "batch_time",
    "data_time_s": "data_time",
}
NOT_SCALARS = ("step", "time", "eta_s")  # metrics.jsonl only: the x axis, the wall clock, a forecast

log = LOGGER

# share of captions cut by the context length above which the run warns (once): a cut caption
# loses its last words, which in short captions often carry the label
TRUNCATION_WARN_SHARE = 0.01


@dataclass
class LogArgs:
    """Run config section ``log``: where the run folder is, what is logged, how often it evaluates."""

    logs: str = opt("./logs", "Folder that holds run folders.")
    name: str | None = opt(None, "Run folder name (default: date-model-lr-batch).")
    log_every_n_steps: int = opt(
        100,
        "Console/TensorBoard/jsonl logging interval in optimizer steps. Without --grad-clip-norm the gradient "
        "norm is computed on these steps only (it is logged, nothing else reads it).",
    )
    report_to: str = opt(
        "", "Comma-separated extra loggers: tensorboard, wandb (all: both). metrics.jsonl is always written."
    )
    wandb_project_name: str = opt("open-clip", "wandb project (OpenCLIP's default name, so runs land side by side).")
    wandb_notes: str = opt("", "wandb run notes.")
    zeroshot_frequency: int = opt(1, "Zero-shot evaluation every N epochs (0: only at the end for the demo).")
    val_frequency: int = opt(1, "Retrieval evaluation on --val-data every N epochs.")
    log_local: bool = opt(
        False, "Every rank writes its own log file RUN/out-RANK.log (else rank 0 writes RUN/out.log)."
    )
    debug: bool = opt(False, "DEBUG-level logging.")
    copy_codebase: bool = opt(False, "Copy the dsclip package into RUN/code before training (reproducibility).")

    def check(self) -> None:
        if self.log_every_n_steps < 1:
            raise ConfigError("'log_every_n_steps' must be >= 1")
        reporters = {r.strip() for r in self.report_to.split(",") if r.strip()}
        unknown = sorted(reporters - set(REPORTERS))
        if unknown:
            raise ConfigError(f"--report-to {unknown[0]!r} is not supported (supported: {', '.join(REPORTERS)})")
        if reporters & {"wandb", "all"} and importlib.util.find_spec("wandb") is None:
            raise ConfigError("--report-to wandb needs the wandb package: pip install wandb (or drop wandb)")
        if self.name is not None and "/" in self.name:
            raise ConfigError(f"--name must be a folder name, not a path: {self.name!r}")


def data_counters(stats: dict[str, int]) -> dict[str, int]:
    """This rank's cumulative data counters as logged: skipped samples, captions cut by the context,
    and (GPU input path) images decoded on the CPU instead of nvJPEG, which are trained on."""
    from dsclip.data.gpu_decode import CPU_DECODED  # lazy: loads torch (LogArgs' parser does not)
    from dsclip.data.tokenizer import TRUNCATED

    return {
        "bad_samples": sum(v for k, v in stats.items() if k not in (TRUNCATED, CPU_DECODED)),
        "truncated_captions": stats.get(TRUNCATED, 0),
        "cpu_decoded_images": stats.get(CPU_DECODED, 0),
    }


def peak_memory_gb(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident set.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory_per_rank_gb(device: torch.device, world_size: int) -> list[float]:
    """Every rank's peak memory (collective when ``world_size`` > 1): rank 0's alone hides the rank that
    runs out first, and the planner's prediction (``dsclip plan``) is per rank."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([peak_memory_gb(device)], dtype=torch.float64, device=device)
    if world_size == 1 or not initialized():  # (tests build a logger for world 2 without a process group)
        return mine.tolist()
    out = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)  # once per logging window: one tiny collective
    return torch.cat(out).tolist()


def console(line: str) -> None:
    """A console line of rank 0 (the caller checks the rank) that also goes into RUN/out.log: the log file
    holds what the console showed, the run header included (dsclip.console)."""
    say(line)


class MetricsLogger:
    @classmethod
    def from_args(
        cls,
        args: LogArgs,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        plan,
        device,
        wandb=None,
        context_length: int | None = None,
    ) -> MetricsLogger:
        """``plan``: the run's dsclip.train.build.StepPlan (samples per step, total steps); ``wandb``: the
        rank's dsclip.train.wandb_sink.WandbSink or None; ``context_length``: for the truncation warning."""
        return cls(
            run_dir,
            rank=rank,
            world_size=world_size,
            every_n_steps=args.log_every_n_steps,
            report_to=args.report_to,
            samples_per_step=plan.samples_per_step,
            total_steps=plan.total_steps,
            steps_per_epoch=plan.steps_per_epoch,
            device=device,
            wandb=wandb,
            context_length=context_length,
        )

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        every_n_steps: int,
        report_to: str,
        samples_per_step: int,
        total_steps: int,
        device: torch.device,
        wandb=None,
        context_length: int | None = None,
        steps_per_epoch: int | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.every = every_n_steps
        self.samples_per_step = samples_per_step  # global: batch × accum_freq × world
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch or total_steps  # the epoch's progress in the line
        self.device = device
        self.context_length = context_length
        self.steps_here = 0  # steps this process ran (the data counters restart on resume)
        # training time of the finished windows (evaluations and saves left out): the ETA's average step time
        self.timed_s = 0.0
        self.timed_steps = 0
        self.truncation_warned = False
        self.cpu_decode_noted = False
        self.jsonl = None
        self.tb = None
        self.wandb = wandb  # train/wandb_sink.WandbSink on rank 0 with --report-to wandb
        self.bar = None
        if rank == 0:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
            if {r.strip() for r in report_to.split(",")} & {"tensorboard", "all"}:
                # lazy: only with --report-to tensorboard; loading the tensorboard writer takes seconds
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            if sys.stderr.isatty():
                self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False)
        self._reset_window()

    def _reset_window(self):
        self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_data_wait = 0.0
        self.window_losses: list[float] = []
        self.window_skipped = 0

    def logs_step(self, step: int) -> bool:
        """Whether step ``step`` (1-based) ends a logging window: only its gradient norm is reported."""
        return step % self.every == 0 or step == self.total_steps

    def step(self, step: int, result, *, data_wait_s: float, lr: float, epoch: int, extra: dict | None = None) -> None:
        """Record a finished optimizer step (1-based ``step``); log when the window is full."""
        self.window_steps += 1
        self.steps_here += 1
        if extra and not self.truncation_warned:
            self._check_truncation(extra.get("truncated_captions", 0))
        if extra and extra.get("cpu_decoded_images") and not self.cpu_decode_noted:
            self.cpu_decode_noted = True
            self.write_line(
                f"note: {extra['cpu_decoded_images']} images so far on rank {self.rank} are not JPEGs nvJPEG decodes "
                f"(PNG, WebP, CMYK, ...) or failed there: decoded on the CPU instead (cpu_decoded_images in the "
                f"step lines); convert the shards to RGB JPEG to keep the workers' CPU free"
            )
        self.window_data_wait += data_wait_s
        if result.applied:
            self.window_losses.append(result.loss)
        else:
            self.window_skipped += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{result.loss:.4f}")
        if self.logs_step(step):
            self.flush(step, result, lr=lr, epoch=epoch, extra=extra)

    def _check_truncation(self, cut: int) -> None:
        captions = self.steps_here * self.samples_per_step // self.world_size  # this rank's, like the counter
        if not captions or cut <= TRUNCATION_WARN_SHARE * captions:
            return
        self.truncation_warned = True
        ctx = f" {self.context_length}" if self.context_length else ""
        self.write_line(
            f"warning: {100 * cut / captions:.1f}% of captions ({cut} of {captions} on rank {self.rank} so far) are "
            f"longer than the context length{ctx} and lose their end; raise --context-length (the text tower's "
            f"positions) or shorten the captions (dsclip tokenizer train --context-length N shows the distribution)"
        )

    def flush(self, step: int, result, *, lr: float, epoch: int, extra: dict | None = None) -> None:
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        samples = self.window_steps * self.samples_per_step
        steps = max(self.window_steps, 1)
        self.timed_s += elapsed
        self.timed_steps += self.window_steps
        loss = sum(self.window_losses) / len(self.window_losses) if self.window_losses else float("nan")
        peaks = peak_memory_per_rank_gb(self.device, self.world_size)  # collective: every rank flushes
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "loss_last": result.loss,
            "lr": lr,
            "logit_scale": result.logit_scale,
            "grad_norm": result.grad_norm,
            "samples_per_s": samples / elapsed,
            "samples_per_s_per_rank": samples / elapsed / self.world_size,
            "data_wait_frac": self.window_data_wait / elapsed,
            "step_time_s": elapsed / steps,  # averaged over the window (OpenCLIP: batch_time)
            "data_time_s": self.window_data_wait / steps,  # waiting for the loader, per step (OpenCLIP: data_time)
            "eta_s": eta_seconds(self.timed_s / max(self.timed_steps, 1), step, self.total_steps),
            "peak_mem_gb": peaks[0],  # rank 0's, as before
            "peak_mem_gb_max": max(peaks),  # the largest over ranks
            "effective_batch": self.samples_per_step,
            "world_size": self.world_size,
            "skipped_steps": self.window_skipped,
            "time": time.time(),
        }
        if self.world_size <= 16:  # each rank's peak while the list stays short
            record["peak_mem_gb_ranks"] = peaks
        if result.logit_bias is not None:
            record["logit_bias"] = result.logit_bias
        if extra:
            record.update(extra)
        if self.rank == 0:
            gn = "n/a" if result.grad_norm is None else f"{result.grad_norm:.3f}"
            progress = epoch_progress(step, epoch, self.steps_per_epoch, self.samples_per_step)
            line = (
                f"step {step}/{self.total_steps} ep {epoch} {progress} | loss {loss:.4f} | "
                f"{timing_text(record['step_time_s'], record['data_time_s'], record['eta_s'])} | lr {lr:.3e} | "
                f"scale {result.logit_scale:.2f} | gnorm {gn} | "
                f"{record['samples_per_s']:.1f} samples/s ({record['samples_per_s_per_rank']:.1f}/rank) | "
                f"batch {self.samples_per_step} | mem {record['peak_mem_gb_max']:.2f} GB (max over ranks)"
            )
            if self.window_skipped:
                line += f" | skipped {self.window_skipped}"
            for k in ("bad_samples", "truncated_captions", "cpu_decoded_images"):
                if extra and extra.get(k):
                    line += f" | {k} {extra[k]}"
            self.write_line(line)
            self.jsonl.write(json.dumps(record) + "\n")
            scalars = {
                f"train/{OPENCLIP_TAGS.get(k, k)}": v
                for k, v in record.items()
                if isinstance(v, (int, float)) and k not in NOT_SCALARS
            }
            self._scalars(scalars, step)
        self._reset_window()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation or a checkpoint save, logged with its own time) out of the
        throughput window."""
        self.window_start += seconds

    def train_seconds(self) -> float:
        """Training time this process spent in steps so far (finished windows and the open one)."""
        return self.timed_s + (time.perf_counter() - self.window_start if self.window_steps else 0.0)

    def write_line(self, line: str) -> None:
        if self.rank != 0:
            return
        if self.bar is not None:
            log.info(line)  # into RUN/out.log (train/runlog.py)
            self.bar.write(line)
        else:
            console(line)

    def log_eval(self, step: int, metrics: dict, prefix: str = "eval") -> None:
        if self.rank != 0:
            return
        self.write_line(
            f"{prefix} @ step {step}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
        )
        self.jsonl.write(json.dumps({"step": step, prefix: metrics, "time": time.time()}) + "\n")
        self._scalars({f"{prefix}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step)

    def _scalars(self, scalars: dict, step: int) -> None:
        """The same scalars, under the same names, to TensorBoard and wandb."""
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step)

    def log_goodput(self, step: int, report: dict) -> None:
        """The run's goodput report (dsclip.train.goodput) at its end: one metrics.jsonl record, and the shares
        as ``goodput/*`` scalars."""
        if self.rank != 0:
            return
        from dsclip.train.goodput import scalars

        self.jsonl.write(json.dumps({"step": step, "goodput": report, "time": time.time()}) + "\n")
        self._scalars(scalars(report), step)

    def mark_resume(self, step: int, checkpoint: str) -> None:
        """One ``{"resumed_from": step}`` record: the steps after it that a reader already saw before it were
        re-run from that checkpoint (the later record of a step is the one that counts)."""
        if self.jsonl is not None:
            record = {"step": step, "resumed_from": step, "checkpoint": checkpoint, "time": time.time()}
            self.jsonl.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.jsonl is not None:
            self.jsonl.close()
