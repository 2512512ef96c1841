"""Evaluation during training: its time is in the log, and not in the training throughput window."""

from __future__ import annotations

import json

import torch

from dsclip.config import make_run_config
from dsclip.data import build_tokenizer
from dsclip.model import create_model
from dsclip.train.evaluation import TrainingEvaluator
from dsclip.train.metrics import MetricsLogger


class _Engine:  # what TrainingEvaluator uses of a DeepSpeed engine
    def __init__(self, module):
        self.module = module

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def test_epoch_eval_time_logged_and_left_out_of_throughput(tmp_path):
    cfg = make_run_config({"name": "t", "zeroshot_data": "demo", "demo_eval_samples": 40, "zeroshot_frequency": 1})
    tok = build_tokenizer(cfg.data, 16, tmp_path / "cache")  # the demo model's context length
    torch.manual_seed(0)
    model = create_model("demo", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id)
    metrics = MetricsLogger(
        tmp_path,
        rank=0,
        world_size=1,
        every_n_steps=10,
        report_to="",
        samples_per_step=8,
        total_steps=100,
        device=torch.device("cpu"),
    )
    ev = TrainingEvaluator(
        cfg.log, cfg.data, tokenizer=tok, image_size=32, device=torch.device("cpu"), run_dir=tmp_path, metrics=metrics
    )
    start = metrics.window_start
    ev.epoch_end(_Engine(model), step=7, epoch=0)
    metrics.close()
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    zs = [r["zeroshot"] for r in rec if "zeroshot" in r]
    assert len(zs) == 1 and 0 <= zs[0]["zeroshot-top1"] <= 1
    assert zs[0]["eval_s"] > 0
    # the window start moved forward by at least the evaluation's time: samples/s excludes it
    assert metrics.window_start - start >= zs[0]["eval_s"]
    assert model.training  # back in training mode


def test_final_evaluation_runs_mid_epoch_and_once_after_an_epoch_end(tmp_path):
    """--zeroshot-data at the end of training: at a --max-steps stop mid-epoch it runs (results.jsonl), after
    an epoch end at the same step it does not run twice; the summary quotes its headline metric."""
    cfg = make_run_config({"name": "t", "zeroshot_data": "demo", "demo_eval_samples": 40, "zeroshot_frequency": 1})
    tok = build_tokenizer(cfg.data, 16, tmp_path / "cache")
    torch.manual_seed(0)
    engine = _Engine(create_model("demo", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id))

    def evaluator(run_dir):
        run_dir.mkdir()
        metrics = MetricsLogger(
            run_dir, rank=0, world_size=1, every_n_steps=10, report_to="", samples_per_step=8, total_steps=100,
            device=torch.device("cpu"),
        )  # fmt: skip
        ev = TrainingEvaluator(
            cfg.log, cfg.data, tokenizer=tok, image_size=32, device=torch.device("cpu"), run_dir=run_dir,
            metrics=metrics,
        )  # fmt: skip
        return ev, metrics

    def zeroshot_steps(run_dir):
        rec = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
        return [(r["step"], r["epoch"]) for r in rec if "zeroshot" in r]

    mid, m = evaluator(tmp_path / "mid")
    mid.final(engine, step=5, epoch=0)  # --max-steps 5 in an epoch of more steps: no epoch end ran
    m.close()
    assert zeroshot_steps(tmp_path / "mid") == [(5, 0)]
    assert mid.headline().startswith("zeroshot-top1 ") and mid.headline().endswith(" @ step 5")

    end, m = evaluator(tmp_path / "end")
    end.epoch_end(engine, step=7, epoch=0)
    end.final(engine, step=7, epoch=0)  # the last step was the epoch's end: evaluated once
    m.close()
    assert zeroshot_steps(tmp_path / "end") == [(7, 0)]
