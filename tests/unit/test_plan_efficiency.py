"""dsclip plan predicts step times from measured MFU (issue 29), and says where each figure comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsclip import plan as P
from dsclip import plan_cli as C
from dsclip.plan_efficiency import ASSUMED_MFU, MEASURED

ROOT = Path(__file__).resolve().parents[2]


def _results_row(m) -> tuple[float, float]:
    """(median samples/s, MFU) of dsclip's eager ZeRO-2 row (not --torchcompile) for this model and
    micro-batch in its results file."""
    for line in (ROOT / m.source).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) >= 4
            and cells[0] == f"{m.model}, {m.micro_batch}"
            and (cells[1] == "dsclip" or cells[1].startswith("dsclip (ZeRO-2"))
        ):
            rate = float(re.match(r"([\d,]+)", cells[2]).group(1).replace(",", ""))
            return rate, float(cells[3].rstrip(" %")) / 100
    raise AssertionError(f"no dsclip row for {m.model}, {m.micro_batch} in {m.source}")


@pytest.mark.parametrize("m", MEASURED, ids=lambda m: m.model)
def test_each_figure_is_its_results_files_row_and_the_plan_reproduces_its_rate(m):
    rate, mfu = _results_row(m)
    assert m.samples_per_s == rate and m.mfu == pytest.approx(mfu, abs=1e-9)
    # the plan of that very run (one GPU, its micro-batch) uses the figure and predicts the measured rate:
    # the planner's FLOP count agrees with gpu_bench's FlopCounterMode count (the MFU's numerator)
    p = P.make_plan(m.model, gpus=1, gpu_memory_gb=140, batch_size=m.micro_batch, zero=m.zero, precision=m.precision)
    assert p.mfu == m.mfu and p.mfu_source.startswith("measured") and m.source in p.mfu_source
    assert p.samples_per_s_per_gpu == pytest.approx(m.samples_per_s, rel=0.03)


def test_unmeasured_models_take_the_nearest_or_largest_measured_figure_and_say_so():
    h = P.make_plan("ViT-H-14", gpus=8, gpu_memory_gb=80, batch_size=1024)
    largest = max(MEASURED, key=lambda m: m.mfu)  # ViT-L-14: the largest measured model
    assert h.mfu == largest.mfu and "the largest model measured" in h.mfu_source and "ViT-H-14 is" in h.mfu_source
    b16 = P.make_plan("ViT-B-16", gpus=8, gpu_memory_gb=80, batch_size=1024)  # 35 GFLOP: nearest is ViT-B-32's 11
    assert "nearest in FLOPs" in b16.mfu_source and b16.mfu == next(m.mfu for m in MEASURED if m.model == "ViT-B-32")


def test_zero3_fp32_and_a_given_mfu_are_labelled():
    z3 = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=1024, zero=3)
    assert "ZeRO-3 is not measured on a GPU yet" in z3.mfu_source
    fp32 = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=256, precision="fp32")
    assert fp32.mfu == ASSUMED_MFU and fp32.mfu_source.startswith("assumed")
    given = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=1024, mfu=0.3)
    assert given.mfu == 0.3 and given.mfu_source == "given (--mfu)"


def test_the_cli_prints_the_figure_and_its_source(capsys):
    assert C.main_plan(["--model", "ViT-L-14", "--gpus", "8", "--global-batch", "1024"]) == 0
    out = capsys.readouterr().out
    assert "MFU 0.451: measured, ViT-L-14 ZeRO-2 bf16 micro-batch 128" in out and MEASURED[1].source in out
