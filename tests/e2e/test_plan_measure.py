"""``dsclip plan ... --measure``: rank 0 of a world-8 job rehearsed on this CPU, printed beside the plan,
leaving nothing behind; its refusals are one line."""

from __future__ import annotations

import os
import re
import tempfile

import pytest

from dsclip.cli.plan import main_plan

PLAN = ["--model", "demo", "--batch-size", "4", "--accum-freq", "2", "--precision", "bf16"]


def test_measure_world8_beside_the_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tempfile.gettempdir()))
    rc = main_plan([*PLAN, "--gpus", "8", "--measure", "--measure-steps", "1", "--measure-device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rank 0 of a world of 8 under torch's fake process group" in out
    assert "losses are meaningless" in out
    # the optimizer partition is 1/8 of the parameters and matches the plan's figure
    m = re.search(
        r"optimizer partition\s+measured ([\d.]+) GiB \((\d+) fp32 elements = params/([\d.]+)\); plan ([\d.]+)", out
    )
    assert m, out
    assert float(m.group(3)) == pytest.approx(8.0, rel=1e-3)
    assert float(m.group(1)) == pytest.approx(float(m.group(4)), rel=0.01)
    assert re.search(r"step time\s+measured\s+[\d.]+ ms host wall time", out)
    assert "all_gather in step" in out and "reduce in backward" in out  # ZeRO-2's traffic, by phase
    assert "nccl-tests" in out  # the link figures come with their source
    # the plan's own step: compute + the exposed communication it derives (dsclip/plan/comm.py), beside the counted
    assert re.search(r"step = compute [\d.]+ s \+ exposed communication [\d.]+ s \(communication [\d.]+% of", out)
    assert "the plan's communication (dsclip/plan/comm.py, bytes derived, not counted)" in out
    # no run folder, checkpoint or rehearsal folder left behind
    assert os.listdir(tmp_path) == []
    assert not [d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("dsclip-rehearsal")]


def test_measure_refusals_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main_plan([*PLAN, "--gpus", "8", "--measure", "--measure-steps", "0"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == "dsclip plan: --measure-steps must be at least 1"
    from dsclip.rehearsal.room import smallest_group_numel

    world = (smallest_group_numel("demo") // 8 + 1) * 8
    rc = main_plan([*PLAN, "--gpus", str(world), "--measure"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the plan's own notes on so many GPUs
    assert rc == 2
    assert err.startswith(f"dsclip plan --measure: --gpus {world}: demo's smallest parameter group")
