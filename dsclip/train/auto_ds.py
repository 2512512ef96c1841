"""``dsclip train --deepspeed-config auto``: the shipped DeepSpeed JSON ``dsclip plan`` would choose for this run.

Rank 0 reads its device's memory, plans every shipped JSON for the run's precision (the ZeRO stage and
offload; dsclip.plan.search) at the real world size and batch, with the run's own micro-batch, loss and
checkpointing fixed (the flags a user gave or the recipe's: this chooses the engine, not the training), and
every rank takes rank 0's answer. The concrete name replaces ``auto`` in the run settings, so run_config.yaml
records it, and a resume of that run keeps it rather than choosing again (a ZeRO-2 checkpoint does not load
into a ZeRO-3 engine). ``auto`` is not the default: see docs/zero-and-precision.md "--deepspeed-config auto".
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from dsclip.config import RunConfig
from dsclip.config_base import ConfigError
from dsclip.dist import from_rank0
from dsclip.train.metrics import console

AUTO = "auto"
MEMORY_ENV = "DSCLIP_DEVICE_MEMORY_GB"  # the device memory to plan with where it cannot be read (CPU), or to override
ASSUMED_GB = 80.0
GiB = 2**30


def device_memory_gb() -> tuple[float, str]:
    """(GiB per device, how it was obtained): the override, else CUDA's total memory, else an assumption."""
    if os.environ.get(MEMORY_ENV):
        try:
            return float(os.environ[MEMORY_ENV]), f"{MEMORY_ENV}"
        except ValueError:
            raise ConfigError(f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r} is not a number of GiB") from None
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB, "read from the GPU"
    return ASSUMED_GB, f"assumed: this device's memory cannot be read; set {MEMORY_ENV}"


def kept_from_resume(cfg: RunConfig) -> str | None:
    """The concrete JSON the run being resumed recorded in its run_config.yaml, or None."""
    if cfg.checkpoint.resume is None:
        return None
    places = [Path(cfg.run_dir) / "run_config.yaml"]
    if cfg.checkpoint.resume != "latest":  # a run folder, RUN/checkpoints/latest or RUN/checkpoints/TAG
        given = Path(cfg.checkpoint.resume).resolve()
        places += [d / "run_config.yaml" for d in (given, given.parent, given.parent.parent)]
    for p in places:
        if p.is_file():
            name = (yaml.safe_load(p.read_text()) or {}).get("train", {}).get("deepspeed_config")
            if name and name != AUTO:
                return name
    return None


def choose(cfg: RunConfig, model_cfg: dict, world_size: int, memory_gb: float) -> tuple[str, str]:
    """(shipped JSON name, why) for this run on ``world_size`` devices of ``memory_gb`` GiB: the run config's
    own job (dsclip.plan.job.Job.from_sections: its precision, micro-batch, loss, checkpointing, locking and
    EMA), the stage and offload open."""
    from dsclip.plan.job import Cluster, Job, plan_job
    from dsclip.plan.report import describe

    # model_cfg is the architecture as this run builds it (--force-image-size etc. applied by finetune.prepare)
    job = Job.from_sections(
        model=cfg.model, train=cfg.train, loss=cfg.loss, lock=cfg.lock, ema=cfg.ema, world=world_size,
        model_cfg=model_cfg,
    )  # fmt: skip
    if job.precision == "auto":  # nothing to take it from: bf16 where a GPU runs it, fp32 on CPU
        import torch

        job.precision = "bf16" if torch.cuda.is_available() else "fp32"
    found = plan_job(job, Cluster(gpu_memory_gb=memory_gb))
    p = found.chosen
    name = Path(p.ds_config).stem
    if not p.fits:
        return name, f"nothing shipped fits by the plan ({describe(p)}); the fastest is tried"
    others = len(found.fitting) - 1
    return name, f"the fastest of {others + 1} shipped configurations that fit: {describe(p)}"


def resolve(cfg: RunConfig, model_cfg: dict, world_size: int, rank: int) -> RunConfig:
    """Replace ``--deepspeed-config auto`` with rank 0's concrete choice on every rank, and say what and why."""
    if cfg.train.deepspeed_config != AUTO:
        return cfg
    answer = None
    if rank == 0:
        try:
            kept = kept_from_resume(cfg)
            if kept is not None:
                answer = (kept, "kept from the run being resumed (its run_config.yaml)")
            else:
                memory, how = device_memory_gb()
                name, why = choose(cfg, model_cfg, world_size, memory)
                answer = (name, f"{why}; {world_size} devices x {memory:.1f} GiB ({how})")
        except (ConfigError, ValueError) as e:  # every rank stops with it, none waits on the broadcast
            answer = (None, f"--deepspeed-config auto: {e}")
    name, why = from_rank0(answer)
    if name is None:
        raise ConfigError(why)
    if rank == 0:
        console(f"dsclip: --deepspeed-config auto -> {name}: {why}")
    cfg.train.deepspeed_config = name
    return cfg
