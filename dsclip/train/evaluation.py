"""Evaluation during and after training; owns its cadence like the checkpointer and the logger.

Runs on every rank (under ZeRO-3 a forward on rank 0 alone would hang): features are computed on
all ranks and gathered by dsclip.eval. Results go to the console, TensorBoard, metrics.jsonl and
<run>/results.jsonl.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsclip.data import DataConfig
from dsclip.eval.evaluator import Evaluator, append_results, evaluate_demo_zeroshot
from dsclip.train.metrics import LogArgs, MetricsLogger

EVAL_NAMES = ("zeroshot", "retrieval", "demo_zeroshot")  # results.jsonl's keys, in the summary's preference
# the one number of each evaluation the summary line quotes (the first present)
HEADLINE_KEYS = ("zeroshot-top1", "imagenetv2-zeroshot-val-top1", "image_to_text_R@1", "shape_top1")


def _inference_mode_ok(engine) -> bool:
    """torch.inference_mode for evaluation forwards, except under ZeRO-3, whose parameter gathering
    needs torch.no_grad (docs: DEEPSPEED-NOTES)."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    return stage != 3


class TrainingEvaluator:
    def __init__(
        self,
        log: LogArgs,
        data: DataConfig,
        *,
        tokenizer,
        image_size: int,
        device: torch.device,
        run_dir: Path,
        metrics: MetricsLogger,
    ):
        self.zeroshot_frequency, self.val_frequency = log.zeroshot_frequency, log.val_frequency
        self.demo_eval_samples = data.demo_eval_samples
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.device = device
        self.results = run_dir / "results.jsonl"
        self.metrics = metrics
        self.evaluator = Evaluator(data, tokenizer=tokenizer, image_size=image_size, device=device)
        self.demo = data.resolved_dataset_type() == "demo"
        self.done: dict[str, int] = {}  # evaluation name -> the step it last ran at (the final one runs once)
        self.headlines: dict[str, tuple[int, str, float]] = {}  # name -> (step, key, value) for the summary
        # which weights the evaluations see: the engine's own, or (--eval-ema) a context that swaps the EMA in
        self.weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def close(self) -> None:
        """Stop the evaluation loaders' workers (collective-free; every exit path of the run calls it)."""
        self.evaluator.close()

    def _log(self, step: int, epoch: int, name: str, res: dict) -> None:
        if not res:
            return
        self.metrics.log_eval(step, res, prefix=name)
        append_results(self.results, {"step": step, "epoch": epoch, name: res})
        key = next((k for k in HEADLINE_KEYS if k in res), None)
        if key is not None:
            self.headlines[name] = (step, key, res[key])

    def headline(self) -> str | None:
        """The last evaluation's headline metric for the run's summary line, e.g. ``zeroshot-top1 0.4210 @ step
        800``; zero-shot before retrieval before the demo's when several ran at the same (last) step."""
        if not self.headlines:
            return None
        order = list(EVAL_NAMES)
        name = max(self.headlines, key=lambda n: (self.headlines[n][0], -order.index(n)))
        step, key, value = self.headlines[name]
        what = key if key.startswith(name) else f"{name} {key}"
        return f"{what} {value:.4f} @ step {step}"

    def epoch_end(self, engine, step: int, epoch: int) -> None:
        """After epoch ``epoch`` (0-based) finished: --zeroshot-frequency / --val-frequency."""
        zs, val = self.zeroshot_frequency, self.val_frequency
        self._run(
            engine,
            step,
            epoch,
            zeroshot=bool(self.evaluator.has_zeroshot and zs and (epoch + 1) % zs == 0),
            retrieval=bool(self.evaluator.has_retrieval and val and (epoch + 1) % val == 0),
        )

    def final(self, engine, step: int, epoch: int) -> dict:
        """End of training, whatever ended it (the last epoch, --max-steps mid-epoch, the end of the data, a
        preemption): --zeroshot-data/--imagenet-val/--imagenet-v2 and --val-data unless their frequency is 0
        (OpenCLIP evaluates at the last epoch too) or they already ran at this step (the last step was an
        epoch end); for demo data, the demo's held-out zero-shot. ``epoch``: the 0-based epoch of ``step``.
        Collective: every rank calls it."""
        ev, done = self.evaluator, self.done
        self._run(
            engine,
            step,
            epoch,
            zeroshot=bool(ev.has_zeroshot and self.zeroshot_frequency and done.get("zeroshot") != step),
            retrieval=bool(ev.has_retrieval and self.val_frequency and done.get("retrieval") != step),
        )
        if not self.demo:
            return {}
        engine.eval()
        res = {}
        with self.weights(), torch.no_grad():
            for task in ("shape", "color"):  # 7 and 8 classes: chance is 14% and 12.5%
                r = evaluate_demo_zeroshot(
                    engine.module,
                    self.tokenizer,
                    num_samples=self.demo_eval_samples,
                    image_size=self.image_size,
                    device=self.device,
                    task=task,
                    mean=self.evaluator.cfg.image_mean,
                    std=self.evaluator.cfg.image_std,
                    inference=_inference_mode_ok(engine),
                )
                res.update({f"{task}_{k}": v for k, v in r.items() if k in ("top1", "top5")})
        self._log(step, epoch, "demo_zeroshot", res)
        return {"zeroshot": res}

    def _run(self, engine, step: int, epoch: int, *, zeroshot: bool, retrieval: bool) -> None:
        """The configured evaluations that are due, logged and appended to results.jsonl (collective)."""
        if not (zeroshot or retrieval):
            return
        self.evaluator.inference = _inference_mode_ok(engine)
        engine.eval()
        t0 = time.perf_counter()
        with self.weights(), torch.no_grad():  # --eval-ema: the EMA weights (dsclip.engine.ema.swapped_into)
            for due, name, fn in (
                (zeroshot, "zeroshot", self.evaluator.zeroshot),
                (retrieval, "retrieval", self.evaluator.retrieval),
            ):
                if due:
                    t = time.perf_counter()
                    res = fn(engine.module)
                    self._log(step, epoch, name, {**res, "eval_s": time.perf_counter() - t})  # its cost, in the log
                    self.done[name] = step
        engine.train()
        self.metrics.exclude(time.perf_counter() - t0)  # training throughput stays training throughput
