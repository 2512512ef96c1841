"""The log says when the run ends: the step line's step/data time, ETA and epoch progress; the checkpoint
and summary lines; the end-of-training evaluation whatever stopped training (issue #33, items 3 and 4)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsclip.train import loop
from dsclip.train import metrics as metrics_mod
from dsclip.train.divergence import DivergenceGuard
from dsclip.train.goodput import Goodput
from dsclip.train.gradcache import StepResult
from dsclip.train.metrics import MetricsLogger
from dsclip.train.progress import epoch_progress, format_duration, summary_line, timing_text


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"), (3720, "1h02m"), (86399, "23h59m"), (183600, "2d03h")],
)
def test_durations_read_like_an_eta(seconds, text):
    assert format_duration(seconds) == text


def test_epoch_progress_is_openclips_samples_of_total():
    # 50 steps of 8 samples per epoch; step 52 is the 2nd step of epoch 1
    assert epoch_progress(52, 1, 50, 8) == "[ 16/400 (4%)]"
    assert epoch_progress(50, 0, 50, 8) == "[400/400 (100%)]"
    assert timing_text(0.5, 0.1, 3720) == "0.500 s/step (data 0.100 s, 20%) | eta 1h02m"


def test_summary_line_names_steps_time_throughput_checkpoint_and_evaluation():
    line = summary_line(
        step=40, steps_run=30, wall_s=125, samples_per_s=512.25, checkpoint="RUN/checkpoints/step_000000040",
        evaluation="zeroshot-top1 0.4210 @ step 40",
    )  # fmt: skip
    assert line == (
        "done: step 40 (30 this run) in 2m05s | 512.2 samples/s | checkpoint RUN/checkpoints/step_000000040 | "
        "last eval zeroshot-top1 0.4210 @ step 40"
    )
    bare = summary_line(
        step=3, steps_run=3, wall_s=5, samples_per_s=1, checkpoint=None, evaluation=None, preempted=True
    )
    assert bare.startswith("stopped (preempted): step 3") and "no checkpoint" in bare and "last eval" not in bare


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_line_has_step_and_data_time_eta_and_epoch_progress(tmp_path, monkeypatch, capsys):
    clock = _Clock()  # a fake clock: the line's numbers are exact, nothing depends on this machine's speed
    monkeypatch.setattr(metrics_mod, "time", SimpleNamespace(perf_counter=clock, time=time.time))
    m = MetricsLogger(
        tmp_path, rank=0, world_size=1, every_n_steps=2, report_to="", samples_per_step=8, total_steps=100,
        steps_per_epoch=50, device=torch.device("cpu"),
    )  # fmt: skip
    seen = {}
    m._scalars = lambda scalars, step: seen.update({step: scalars})
    result = StepResult(loss=1.0, logit_scale=14.0, logit_bias=None, grad_norm=1.0, applied=True)
    for step, now, wait in ((1, 0.5, 0.1), (2, 1.0, 0.1), (3, 2.5, 0.0), (4, 4.0, 0.6)):
        clock.now = now
        m.step(step, result, data_wait_s=wait, lr=1e-3, epoch=0)
    m.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    # window 1: 2 steps in 1.0 s, 0.2 s waiting; ETA: 98 steps left at 0.5 s
    assert lines[0].startswith("step 2/100 ep 0 [ 16/400 (4%)] | loss 1.0000 | ")
    assert "| 0.500 s/step (data 0.100 s, 20%) | eta 49s |" in lines[0]
    # window 2: 1.5 s/step, but the ETA uses the run's average (4 steps in 4.0 s): 96 s
    assert lines[1].startswith("step 4/100 ep 0 [ 32/400 (8%)]")
    assert "| 1.500 s/step (data 0.300 s, 20%) | eta 1m36s |" in lines[1]
    # OpenCLIP's TensorBoard names for the same numbers; the forecast stays out of the scalars
    assert seen[2]["train/batch_time"] == pytest.approx(0.5) and seen[2]["train/data_time"] == pytest.approx(0.1)
    assert seen[4]["train/batch_time"] == pytest.approx(1.5) and "train/eta_s" not in seen[4]


class _Checkpointer:
    def __init__(self, events):
        self.events, self.dir, self.last_saved_step = events, Path("RUN/checkpoints"), None
        self.in_flight = None  # a blocking save: nothing written in the background

    def save(self, engine, step, state):
        self.events.append(("save", step))
        self.last_saved_step = step

    def certify(self, step):  # a finished run's last finite step vouches for its checkpoint (divergence)
        self.events.append(("certify", step))


class _Evaluator:
    def __init__(self, events):
        self.events = events

    def final(self, engine, step, epoch):
        self.events.append(("final_eval", step, epoch))
        return {}

    def headline(self):
        return "zeroshot-top1 0.2500 @ step 7"


class _Metrics:
    steps_here = 7

    def __init__(self, events):
        self.events = events

    def exclude(self, seconds):
        pass

    def write_line(self, line):
        self.events.append(("line", line))

    def train_seconds(self):
        return 1.0

    def log_goodput(self, step, report):
        self.events.append(("goodput", step, report["starts"]))

    def close(self):
        pass


@pytest.mark.parametrize("preempted", [None, "terminate"], ids=["max_steps_mid_epoch", "sigterm"])
def test_training_ends_with_save_then_evaluation_then_summary(monkeypatch, capsys, preempted):
    """--max-steps mid-epoch and a preemption alike: the checkpoint first (a preemption's grace time is for
    it), then the end-of-training evaluation, then the summary line."""
    events: list = []
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save_frequency=1, save_every_n_steps=0), run_dir=Path("RUN"))
    run = SimpleNamespace(
        cfg=cfg, rank=0, engine=None, checkpointer=_Checkpointer(events), evaluator=_Evaluator(events),
        metrics=_Metrics(events), data=SimpleNamespace(close=lambda: None),
        plan=SimpleNamespace(steps_per_epoch=10, samples_per_step=8), client_state=lambda step: {"step": step},
        guard=DivergenceGuard(20),  # no step was bad: the end-of-run save goes ahead
        hang=None,  # fit() is replaced: no hang bounds were armed
        goodput=Goodput(),
    )  # fmt: skip
    monkeypatch.setattr(loop, "build_run", lambda c, closing, clock: run)
    monkeypatch.setattr(loop, "fit", lambda r: (7, preempted))  # stopped at step 7 of a 10-step epoch
    monkeypatch.setattr(
        loop.runlog, "write_exit_status", lambda run_dir, **kw: events.append(("exit_status", kw["exit_code"]))
    )
    summary = loop._train(cfg)
    # the exit status (what the batch scripts read) once the checkpoint is safe, before the evaluation; again
    # after it, with the goodput up to the end line
    assert [e[0] for e in events if e[0] != "certify"] == [
        "save", "line", "exit_status", "final_eval", "exit_status", "goodput"
    ]  # fmt: skip
    events = [e for e in events if e[0] != "certify"]
    assert events[1][1].startswith("checkpoint saved: RUN/checkpoints/step_000000007 (step 7, ")
    assert events[2] == ("exit_status", 143 if preempted else 0)
    assert events[3] == ("final_eval", 7, 0)
    out = capsys.readouterr().out
    how = "stopped (preempted)" if preempted else "done"
    assert f"{how}: step 7 (7 this run) in " in out
    assert "56.0 samples/s | checkpoint RUN/checkpoints/step_000000007 | last eval zeroshot-top1 0.2500" in out
    assert " @ step 7 | goodput " in out  # the run's wall time by kind ends the line (dsclip.train.goodput)
    assert summary["step"] == 7
