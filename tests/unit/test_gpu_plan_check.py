"""bench/gpu_plan_check.py's search logic, which the GPU stage (bench/gpu_h200.sh ``bigg``) relies on and no
CPU run exercises (on CPU nothing runs out of memory): the probe sequence from the planner's largest
micro-batch against a stand-in ``fits`` with a known edge, and the planner-side search. The probes
themselves (engine, steps, memory) run on CPU in the script's ``--device cpu`` mode."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("gpu_plan_check", ROOT / "bench" / "gpu_plan_check.py")
PC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(PC)


def _edge(largest):
    calls = []

    def fits(m):
        calls.append(m)
        return m <= largest

    return fits, calls


@pytest.mark.parametrize("true_largest", [80, 100, 114, 130, 200])
def test_two_probes_bracket_or_locate_the_edge_around_the_prediction(true_largest):
    fits, calls = _edge(true_largest)
    lo, hi, tried = PC.probe_sizes(100, fits, 0.15, 2)
    assert calls == [m for m, _ in tried] and len(calls) == 2 and calls[0] == 100
    assert all(ok == (m <= true_largest) for m, ok in tried)
    assert calls[1] == (115 if true_largest >= 100 else 85)  # one tolerance step toward the edge
    assert lo <= true_largest and (hi is None or hi > true_largest)
    # the two probes say whether the prediction is within 15 %: the edge is bracketed exactly then
    if 85 <= true_largest < 115:
        assert (lo, hi) in ((100, 115), (85, 100))


@pytest.mark.parametrize("true_largest", [1, 37, 99, 100, 101, 163, 1000])
def test_more_probes_find_the_exact_edge(true_largest):
    fits, _ = _edge(true_largest)
    lo, hi, tried = PC.probe_sizes(100, fits, 0.15, 40)
    assert lo == true_largest and hi == true_largest + 1
    assert len({m for m, _ in tried}) == len(tried)  # no size probed twice


def test_nothing_fits():
    lo, hi, tried = PC.probe_sizes(8, lambda m: False, 0.15, 6)
    assert lo == 0 and hi == 1 and tried[-1] == (1, False)


@pytest.mark.parametrize("edge", [0, 1, 2, 3, 1298, 4097])
def test_largest_planned_is_the_edge_of_the_plan(edge):
    assert PC.largest_planned(lambda m: m <= edge) == edge


def test_compare_is_relative_to_the_measurement():
    assert PC.compare(110.0, 100.0) == pytest.approx(0.10)
    assert PC.compare(75.0, 100.0) == pytest.approx(-0.25)


def _engine_checkpointing(rank, world, grad_checkpointing):
    import harness as H

    from dsclip.model import get_model_config

    engine, _, _ = H.dsclip_engine(
        "fp32", 2, 1, get_model_config("demo"), world, extra={"deepspeed_config": "ds_configs/zero3_fp32.json"},
        grad_checkpointing=grad_checkpointing,
    )  # fmt: skip
    model = engine.module
    return model.visual.grad_checkpointing, model.text.grad_checkpointing


def test_the_bench_engine_checkpoints_when_asked():
    # the probes of the bigg stage asked for --grad-checkpointing and ran without it (the same peak memory on
    # the H200, 2026-12-04): bench's engine builder must hand the flag to build_engine, as dsclip train does
    from dsclip.testing.gloo_world import run_world

    assert run_world(_engine_checkpointing, 1, True) == [(True, True)]
