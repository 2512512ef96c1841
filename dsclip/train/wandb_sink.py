"""Weights & Biases output (OpenCLIP's --report-to wandb, --wandb-project-name, --wandb-notes).

wandb is optional: asking for it without the package installed is a one-line error before any work
(config.validate). Only rank 0 logs. The wandb run id is kept in ``RUN/wandb_id`` so that a resumed
run (``--resume``) continues the same wandb run instead of starting a new one: a requeued job's
curves stay one curve.
"""

from __future__ import annotations

import importlib
import secrets
from pathlib import Path

ID_FILE = "wandb_id"


def requested(report_to: str) -> bool:
    return bool({r.strip() for r in report_to.split(",")} & {"wandb", "all"})


class WandbSink:
    def __init__(self, run_dir: Path, *, project: str, notes: str, name: str, config: dict, resuming: bool):
        self.wandb = importlib.import_module("wandb")
        id_file = run_dir / ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else None
        if run_id is None:
            run_id = secrets.token_hex(4)  # wandb's own ids are 8 characters of [0-9a-z] too
            id_file.write_text(run_id + "\n")
        self.run_id = run_id
        self.run = self.wandb.init(
            project=project,
            name=name,
            id=run_id,
            notes=notes or None,
            config=config,
            dir=str(run_dir),
            resume="allow",  # same id: continue that run (its steps go on from where it stopped)
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def for_run(cfg, rank: int) -> WandbSink | None:
    """The sink of this rank: rank 0 of a run with --report-to wandb, else None."""
    if rank != 0 or not requested(cfg.log.report_to):
        return None
    return WandbSink(
        cfg.run_dir,
        project=cfg.log.wandb_project_name,
        notes=cfg.log.wandb_notes,
        name=str(cfg.log.name),
        config=cfg.to_dict(),
        resuming=cfg.checkpoint.resume is not None,
    )
