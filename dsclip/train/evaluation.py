"""Evaluation during and after training; owns its cadence like the checkpointer and the logger.

Runs on every rank (under ZeRO-3 a forward on rank 0 alone would hang): features are computed on
all ranks and gathered by dsclip.eval. Results go to the console, TensorBoard, metrics.jsonl and
<run>/results.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dsclip.data import DataConfig
from dsclip.eval.evaluator import Evaluator, append_results, evaluate_demo_zeroshot
from dsclip.train.metrics import LogArgs, MetricsLogger


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

    def _log(self, step: int, epoch: int, name: str, res: dict) -> None:
        if not res:
            return
        self.metrics.log_eval(step, res, prefix=name)
        append_results(self.results, {"step": step, "epoch": epoch, name: res})

    def epoch_end(self, engine, step: int, epoch: int) -> None:
        """After epoch ``epoch`` (0-based) finished: --zeroshot-frequency / --val-frequency."""
        zs, val = self.zeroshot_frequency, self.val_frequency
        due_zs = self.evaluator.has_zeroshot and zs and (epoch + 1) % zs == 0
        due_val = self.evaluator.has_retrieval and val and (epoch + 1) % val == 0
        if not (due_zs or due_val):
            return
        self.evaluator.inference = _inference_mode_ok(engine)
        engine.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            for due, name, fn in (
                (due_zs, "zeroshot", self.evaluator.zeroshot),
                (due_val, "retrieval", self.evaluator.retrieval),
            ):
                if due:
                    t = time.perf_counter()
                    res = fn(engine.module)
                    self._log(step, epoch, name, {**res, "eval_s": time.perf_counter() - t})  # its cost, in the log
        engine.train()
        self.metrics.exclude(time.perf_counter() - t0)  # training throughput stays training throughput

    def final(self, engine, step: int, epoch: int) -> dict:
        """End of training: the demo's held-out zero-shot (shape and colour prompts) for demo data."""
        if not self.demo:
            return {}
        engine.eval()
        res = {}
        with torch.no_grad():
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
