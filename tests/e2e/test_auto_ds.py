"""`dsclip train --deepspeed-config auto` on two CPU ranks: rank 0 chooses from the device memory (the override
DSCLIP_DEVICE_MEMORY_GB, since a CPU's cannot be read), both ranks build that engine, run_config.yaml records the
concrete name, and a resume keeps the recorded name instead of choosing again. One spawned world per run."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.e2e.test_train_cli import run_cli


@pytest.mark.dist
def test_auto_is_chosen_once_recorded_and_kept_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCLIP_DEVICE_MEMORY_GB", "64")
    common = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "auto", "--deepspeed-config", "auto",
              "--save-every-n-steps", "2", "--batch-size", "8", "--precision", "auto"]  # fmt: skip
    first = run_cli([*common, "--max-steps", "2"], world=2)
    said = [ln for ln in first.stdout.splitlines() if "--deepspeed-config auto ->" in ln]
    assert len(said) == 1, first.stdout[-3000:]  # rank 0 says it, once
    # which stage: the planner's (for the tiny model at world 2 ZeRO-2 and ZeRO-3 predict within 0.2 % of each
    # other, both communication-bound); what is checked is that the choice is said once, recorded and built
    chosen = re.search(r"-> (zero(\d)_fp32): the fastest of", said[0])
    assert chosen and "2 devices x 64.0 GiB (DSCLIP_DEVICE_MEMORY_GB)" in said[0], said[0]
    name, stage = chosen.group(1), int(chosen.group(2))
    run = tmp_path / "auto"
    assert yaml.safe_load((run / "run_config.yaml").read_text())["train"]["deepspeed_config"] == name
    assert json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    assert f"world 2 | ZeRO-{stage} fp32" in first.stdout  # the engine both ranks built (a mismatch would hang)

    # the record, not a new choice, decides the resumed run: name the same JSON another way to tell them apart
    rc = yaml.safe_load((run / "run_config.yaml").read_text())
    rc["train"]["deepspeed_config"] = f"zero{stage}"  # ds_configs/zero{2,3}.json: precision from --precision
    (run / "run_config.yaml").write_text(yaml.safe_dump(rc, sort_keys=False))
    again = run_cli([*common, "--max-steps", "3", "--resume", "latest"], world=2)
    said = [ln for ln in again.stdout.splitlines() if "--deepspeed-config auto ->" in ln]
    assert said == [
        f"dsclip: --deepspeed-config auto -> zero{stage}: kept from the run being resumed (its run_config.yaml)"
    ]
    assert yaml.safe_load((run / "run_config.yaml").read_text())["train"]["deepspeed_config"] == f"zero{stage}"
