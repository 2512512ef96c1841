"""OpenCLIP's options through `dsclip train` itself: the run-folder effects of --log-local,
--copy-codebase, --save-most-recent, --skip-scheduler, --force-quick-gelu and --report-to wandb
(offline) across a --resume, and their bad values as one-line errors."""

from __future__ import annotations

import json

import pytest

from dsclip.checkpoint import ds_checkpoint as dc
from tests.e2e.test_train_cli import assert_bad_train_in_process, assert_bad_train_process, run_cli


def test_openclip_flags_through_a_run_and_its_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the dev extra")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "oc"

    def args(epochs):
        return (
            ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "oc", "--resume", "latest"]
            + ["--demo-num-samples", "64", "--max-steps", "100", "--epochs", str(epochs), "--save-frequency", "2"]
            + ["--save-most-recent", "--skip-scheduler", "--force-quick-gelu", "--log-local", "--copy-codebase"]
            + ["--ddp-static-graph", "--report-to", "tensorboard,wandb", "--wandb-notes", "e2e", "--debug"]
        )

    first = run_cli(args(2))  # 64 samples / batch 16 = 4 steps per epoch
    # the default context length cuts no demo caption: no warning, zero counted (the control run of
    # test_training_counts_cut_captions_and_warns_once, made here to save a process start)
    assert "warning:" not in first.stdout, first.stdout[-3000:]
    ckpts = run_dir / "checkpoints"
    # epoch 1's save exists only for --save-most-recent and gave way to epoch 2's (--save-frequency 2)
    assert dc.complete_tags(ckpts) == ["step_000000008"]
    run_cli(args(3))
    assert dc.complete_tags(ckpts) == ["step_000000008", "step_000000012"]
    assert (ckpts / "latest").read_text() == "step_000000012"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert sorted(lrs) == list(range(1, 13)) and set(lrs.values()) == {2.0e-3}  # no warm-up, no decay
    cut = [r["truncated_captions"] for r in records if "truncated_captions" in r]
    assert len(cut) >= 4 and set(cut) == {0}, cut
    model_cfg = json.loads((ckpts / "step_000000012" / dc.MODEL_CONFIG_FILE).read_text())["model_cfg"]
    assert model_cfg["quick_gelu"] is True  # tiny.json says false
    log = (run_dir / "out-0.log").read_text()
    assert "step 1/" in log and "step 12/" in log and "| DEBUG |" in log
    assert (run_dir / "code" / "dsclip" / "compat.py").exists()

    from tests.unit.test_parity_flags import wandb_records

    ids, rows = wandb_records(run_dir, steps=set(range(1, 13)))
    assert len(ids) == 2 and ids[0] == ids[1] == (run_dir / "wandb_id").read_text().strip()
    steps = sorted({r["_step"] for r in rows if "train/loss" in r})
    assert steps == list(range(1, 13))
    assert sum("demo_zeroshot/shape_top1" in r for r in rows) == 2  # eval scalars too, once per run


def test_bad_momentum_is_one_line_and_nonzero(tmp_path):
    # a real process: the exit code and stderr of `python -m dsclip`; --momentum is checked after the world is up
    assert_bad_train_process(tmp_path, ["--momentum", "0.9"], "--momentum: dsclip's default optimizer is AdamW")


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--report-to", "tensorboard,mlflow"], "--report-to 'mlflow' is not supported"),
        (["--precision", "pure_bf16"], "use --precision bf16"),
    ],
    ids=["report_to", "pure_precision"],
)
def test_bad_openclip_values_are_one_line_and_nonzero(tmp_path, capsys, monkeypatch, extra, expect):
    # run-config errors, raised before the world starts: the CLI's main in this process gives the exit code and
    # stderr a subprocess would (a process start costs seconds; test_bad_momentum_... covers the real exit path)
    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    assert_bad_train_in_process(tmp_path, capsys, extra, expect)


def test_training_counts_cut_captions_and_warns_once(tmp_path):
    # the demo's captions are longer than 4 tokens: nearly all are cut at --context-length 4. The control (the
    # default context length cuts none, no warning) is asserted on the run of
    # test_openclip_flags_through_a_run_and_its_resume.
    base = ["train", "--config", "tiny", "--logs", str(tmp_path), "--max-steps", "3"]
    out = run_cli(base + ["--name", "cut4", "--force-context-length", "4"]).stdout
    assert out.count("warning:") == 1 and "longer than the context length 4" in out
    recs = [json.loads(line) for line in (tmp_path / "cut4" / "metrics.jsonl").read_text().splitlines()]
    counts = [r["truncated_captions"] for r in recs if "truncated_captions" in r]
    assert len(counts) == 3 and counts[-1] > 0.9 * 3 * 16 and counts == sorted(counts)  # cumulative
