"""One job description (dsclip.plan.job) for ``dsclip plan``, ``--measure``, ``--deepspeed-config auto`` and the
rehearsal: what one of them is told, the others see. Each of the bugs the five hand-translated shapes had is
held here: a shipped JSON name the rehearsal could not find, a rehearsal of the default loss instead of the
plan's, and ``auto``'s own precision table and forgotten EMA."""

from __future__ import annotations

import re

import pytest

from dsclip.cli import plan as C
from dsclip.config import parse_run_config
from dsclip.engine.ds_config import load_ds_json, run_precision
from dsclip.model import get_model_config
from dsclip.plan.job import Cluster, Job, plan_job
from dsclip.rehearsal import room
from dsclip.train import auto_ds

DEMO = ["--model", "demo", "--gpus", "2", "--batch-size", "4", "--measure", "--measure-device", "cpu"]


@pytest.fixture
def rehearsed(monkeypatch):
    """The spec ``--measure`` hands the rehearsal (which is not run: the plan's side is what is checked)."""
    seen = []

    def rehearse_many(specs, timeout_s=1800.0):  # one spec per gradient reduction the plan weighed
        seen.extend(specs)
        raise room.RehearsalError("stopped by the test")

    monkeypatch.setattr(room, "rehearse_many", rehearse_many)
    return seen


def test_measure_finds_a_shipped_json_by_name_as_plan_and_train_do(rehearsed, capsys):
    """``--deepspeed-config zero3_bf16 --measure`` stopped with "DeepSpeed config not found: .../zero3_bf16"
    while the plan (and dsclip train) took the name: the rehearsal now runs the JSON the plan ran."""
    assert C.main_plan([*DEMO, "--deepspeed-config", "zero3_bf16"]) == 2
    assert capsys.readouterr().err.strip().endswith("dsclip plan --measure: stopped by the test")
    spec = rehearsed[0]
    assert spec.ds_config == load_ds_json("zero3_bf16")


def test_measure_rehearses_the_loss_the_plan_chose(rehearsed, capsys):
    """The rehearsal trained the default loss (LossArgs()), whatever the plan chose."""
    argv = [*DEMO, "--loss", "infonce_tiled", "--loss-tile-size", "64", "--force-patch-dropout", "0.5"]
    assert C.main_plan(argv) == 2
    chosen = re.search(r"^dsclip plan: .* \| loss (\w+)", capsys.readouterr().out, re.M).group(1)  # the headline
    spec = rehearsed[0]
    assert spec.loss == chosen == "infonce_tiled"
    # and the child builds that loss (and the planned patch dropout): the run sections it trains with
    sections = spec.job().sections(deepspeed_config="x.json")
    assert sections["loss"].name == "infonce_tiled" and sections["loss"].loss_tile_size == 64
    assert sections["model"].force_patch_dropout == spec.patch_dropout == 0.5


def _auto_cfg(*flags):
    argv = ["--config", "ViT-bigG-14", "--deepspeed-config", "auto", "--batch-size", "8", "--accum-freq", "4"]
    return parse_run_config([*argv, *flags, "--name", "x"])


def test_auto_maps_every_precision_spelling_train_takes():
    """auto's own table knew amp and amp_bf16 only: amp_bfloat16 planned "precision amp_bfloat16", for which
    nothing shipped exists."""
    bigg = get_model_config("ViT-bigG-14")
    for spelling, want in (("amp_bfloat16", "bf16"), ("amp_bf16", "bf16"), ("bf16", "bf16"), ("amp", "fp16")):
        name, why = auto_ds.choose(_auto_cfg("--precision", spelling), bigg, 8, 80.0)
        assert name.endswith(want) and why.startswith("the fastest of"), (spelling, name, why)
        assert run_precision(spelling) == want


def test_auto_counts_the_ema_the_run_keeps():
    """``--ema-decay`` never reached auto's plan: the sharded fp32 EMA (4 B x params / world) was not counted."""
    bigg = get_model_config("ViT-bigG-14")
    cfg, ema = _auto_cfg("--precision", "bf16"), _auto_cfg("--precision", "bf16", "--ema-decay", "0.999")
    job = Job.from_sections(model=ema.model, train=ema.train, loss=ema.loss, lock=ema.lock, ema=ema.ema, world=1)
    assert job.ema_decay == 0.999
    planned = plan_job(job, Cluster(gpu_memory_gb=80.0)).chosen.memory_gb
    assert planned["ema"] == pytest.approx(4 * planned_params(job) / 2**30, rel=1e-3)
    _, without = auto_ds.choose(cfg, bigg, 1, 80.0)
    _, with_ema = auto_ds.choose(ema, bigg, 1, 80.0)
    assert without != with_ema  # the chosen configuration's memory (or the choice itself) moves with the EMA


def planned_params(job: Job) -> int:
    from dsclip.plan.architecture import load_arch

    return load_arch(job.model).trainable_params


def test_a_job_from_the_run_config_is_the_job_the_plan_plans():
    """from_sections and sections are inverses on what a run sets, and the job fixes the run's training."""
    cfg = _auto_cfg("--precision", "amp_bfloat16", "--deepspeed-config", "zero3_bf16", "--grad-checkpointing")
    job = Job.from_sections(model=cfg.model, train=cfg.train, loss=cfg.loss, lock=cfg.lock, ema=cfg.ema, world=8)
    assert (job.gpus, job.batch_size, job.micro_batch, job.accum_freq) == (8, 8 * 4 * 8, 8, 4)
    assert job.precision == "bf16" and job.ds_config == ("zero3_bf16", load_ds_json("zero3_bf16"))
    assert job.fixed() == {"ds_config": job.ds_config, "loss": cfg.loss.name, "grad_checkpointing": True,
                           "micro_batch": 8}  # fmt: skip
    s = job.sections()
    assert (s["train"].batch_size, s["train"].accum_freq, s["train"].deepspeed_config) == (8, 4, "zero3_bf16")
    assert s["model"].grad_checkpointing and s["loss"].name == cfg.loss.name
    assert Job.from_dict(job.to_dict()) == job  # what the rehearsal's child reads back
