"""bench/gpu_world.py's memory check (the GPU stage ``world`` of bench/gpu_h200.sh): what it parses and the
comparison it prints, on a made-up result, so the one GPU call of the next lease cannot fail on arithmetic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dsclip.plan.planner import make_plan
from dsclip.rehearsal.room import RehearsalResult

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_world", ROOT / "bench" / "gpu_world.py")
GW = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(GW)
GiB = 2**30


def test_memory_check_spec_parses_and_refuses_in_one_line():
    assert GW.parse_memory_check("32:ViT-bigG-14=64:ckpt:zero2") == (32, "ViT-bigG-14", 64, True, "zero2")
    assert GW.parse_memory_check("8:demo=4:zero3") == (8, "demo", 4, False, "zero3")
    with pytest.raises(SystemExit, match="want WORLD:MODEL=MICRO"):
        GW.parse_memory_check("32:ViT-bigG-14=64:ckpt:zero9")


def test_memory_row_sets_the_plan_less_its_reserve_beside_the_measured_peak():
    plan = make_plan("demo", gpus=32, gpu_memory_gb=141.0, batch_size=4 * 32, zero=2, micro_batch=4)
    planned = plan.memory_gb["total"] - plan.memory_gb["reserve (CUDA context, allocator)"]
    assert plan.tensor_bytes / GiB == pytest.approx(planned, abs=2e-3)  # the same, unrounded
    planned = plan.tensor_bytes / GiB
    spec = {"batch_size": 4, "accum_freq": 1, "grad_checkpointing": False}
    r = RehearsalResult(spec=spec, params=plan.params, step_s=[0.1], skipped=0, peak_bytes=int(planned * GiB / 1.25),
                        peak_kind="CUDA max_memory_allocated", optimizer_numel=0, optimizer_bytes=0, traffic=[],
                        loss_finite=True)  # fmt: skip
    line, data = GW.memory_row(32, "demo", "zero2", r)
    assert data["plan_gib_less_reserve"] == pytest.approx(planned)
    assert data["measured_gib"] == pytest.approx(planned / 1.25, rel=1e-6)
    assert "| +25.0% |" in line  # the plan's figure against the measured peak
    assert data["full_bf16_grads_gib"] == pytest.approx(2 * plan.params / GiB)
    assert "plan parts (GiB): params" in line and "measured: CUDA max_memory_allocated" in line


def test_a_world_row_becomes_a_table_row_at_the_planners_mfu_convention():
    plan = make_plan("demo", gpus=8, gpu_memory_gb=141.0, batch_size=4 * 2 * 8, zero=2, micro_batch=4)
    spec = {"batch_size": 4, "accum_freq": 2, "grad_checkpointing": False, "device": "cuda"}
    r = RehearsalResult(spec=spec, params=plan.params, step_s=[0.01], skipped=0, peak_bytes=GiB, peak_kind="",
                        optimizer_numel=0, optimizer_bytes=0, traffic=[], loss_finite=True)  # fmt: skip
    row = GW.table_row(8, "demo", "zero2", r, plan, 0.01, 2)
    mfu = plan.train_gflops_per_sample * 1e9 * 800 / 790e12  # 8 rows in 0.01 s
    assert f"800.0, {mfu:.4f}" in row and "world=8" in row and "accum_freq=2" in row
    assert GW.table_row(8, "demo", "zero2_none", r, plan, 0.01, 2) == ""  # not the shipped patch set
    assert GW.table_row(8, "demo", "zero2", RehearsalResult(**{**r.__dict__, "spec": {**spec, "device": "cpu"}}),
                        plan, 0.01, 2) == ""  # a CPU's host time is never a table row  # fmt: skip
