"""dsclip plan predicts step times from measured MFU (issue 29), and says where each figure comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsclip.cli import plan as C
from dsclip.plan import planner as P
from dsclip.plan.efficiency import ASSUMED_MFU, MEASURED, executed_share

ROOT = Path(__file__).resolve().parents[2]


def _results_row(m) -> tuple[float, float]:
    """(median samples/s, MFU) of dsclip's eager row (not --torchcompile) at this ZeRO stage for this model
    and micro-batch (x K, the gradient cache) in its results file."""
    shape = f"{m.model}, {m.micro_batch}" + (f" × {m.accum_freq}" if m.accum_freq > 1 else "")
    trainer = f"dsclip (ZeRO-{m.zero}"
    for line in (ROOT / m.source).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) >= 4
            and cells[0] == shape
            and ((cells[1] == "dsclip" and m.zero == 2) or cells[1].startswith(trainer))
            and "stock" not in cells[1]
            and "DeepSpeed's linear" not in cells[1]
        ):
            rate = float(re.match(r"([\d,.]+)", cells[2]).group(1).replace(",", ""))
            return rate, float(cells[3].rstrip(" %")) / 100
    raise AssertionError(f"no {trainer} row for {shape} in {m.source}")


@pytest.mark.parametrize("m", MEASURED, ids=lambda m: f"{m.model}-zero{m.zero}-k{m.accum_freq}")
def test_each_figure_is_its_results_files_row_and_the_plan_reproduces_its_rate(m):
    rate, mfu = _results_row(m)
    assert m.samples_per_s == rate and m.mfu == pytest.approx(mfu, abs=1e-9)
    # the plan of that very run (one GPU, its micro-batch) uses the figure and predicts the measured rate:
    # the planner's FLOP count agrees with gpu_bench's FlopCounterMode count (the MFU's numerator)
    p = P.make_plan(
        m.model, gpus=1, gpu_memory_gb=140, batch_size=m.micro_batch * m.accum_freq, micro_batch=m.micro_batch,
        zero=m.zero, precision=m.precision, grad_checkpointing=m.grad_checkpointing,
    )  # fmt: skip
    assert p.accum_freq == m.accum_freq
    assert p.mfu == m.mfu and p.mfu_source.startswith("measured") and m.source in p.mfu_source
    assert p.samples_per_s_per_gpu == pytest.approx(m.samples_per_s, rel=0.03)


def test_unmeasured_models_take_the_nearest_or_largest_measured_figure_and_say_so():
    h = P.make_plan("ViT-H-14", gpus=8, gpu_memory_gb=80, batch_size=1024)
    largest = max(MEASURED, key=lambda m: m.mfu)  # ViT-L-14: the largest measured model
    assert h.mfu == largest.mfu and "the largest model measured" in h.mfu_source and "ViT-H-14 is" in h.mfu_source
    b16 = P.make_plan("ViT-B-16", gpus=8, gpu_memory_gb=80, batch_size=1024)  # 35 GFLOP: nearest is ViT-B-32's 11
    assert "nearest in FLOPs" in b16.mfu_source and b16.mfu == next(m.mfu for m in MEASURED if m.model == "ViT-B-32")


def test_zero3_plans_take_the_measured_zero3_rows_and_say_which():
    # ViT-L-14 at K = 1: its own ZeRO-3 row (measured at K = 2), moved to K = 1 at the same utilisation
    z3 = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=1024, zero=3, micro_batch=128)
    row = next(m for m in MEASURED if (m.model, m.zero) == ("ViT-L-14", 3))
    assert z3.accum_freq == 1 and z3.mfu_source.startswith(f"measured, {row.describe()}")
    assert z3.mfu == pytest.approx(row.mfu * executed_share(2, False) / executed_share(1, False), abs=1e-4)
    # a model without a ZeRO-3 row: its ZeRO-2 figure times ZeRO-3's share measured on ViT-L-14 in one run
    b16 = P.make_plan("ViT-B-16", gpus=8, gpu_memory_gb=80, batch_size=1024, zero=3)
    assert "ZeRO-3's share of ZeRO-2's MFU measured on ViT-L-14" in b16.mfu_source
    assert "not measured" not in b16.mfu_source
    z2 = P.make_plan("ViT-B-16", gpus=8, gpu_memory_gb=80, batch_size=1024, zero=2)
    assert b16.mfu == pytest.approx(z2.mfu * 0.108 / 0.363, abs=1e-4)


def test_a_row_moves_to_the_plans_accumulation_and_checkpointing_at_the_same_utilisation():
    # ViT-L-14 ZeRO-2 has rows at K = 1 and K = 2: each plan takes the one run like it, unchanged
    k1 = P.make_plan("ViT-L-14", gpus=1, gpu_memory_gb=140, batch_size=128, micro_batch=128)
    k2 = P.make_plan("ViT-L-14", gpus=1, gpu_memory_gb=140, batch_size=128, micro_batch=64)
    assert (k1.accum_freq, k1.mfu) == (1, 0.451) and (k2.accum_freq, k2.mfu) == (2, 0.363)
    # checkpointing re-forwards everything: a third more executed FLOPs, so a third less MFU
    ck = P.make_plan("ViT-L-14", gpus=1, gpu_memory_gb=140, batch_size=128, micro_batch=128, grad_checkpointing=True)
    assert ck.mfu == pytest.approx(0.451 * 3 / 4, abs=1e-4) and "--grad-checkpointing" in ck.mfu_source
    assert ck.hfu == pytest.approx(0.451, abs=2e-3)  # the hardware utilisation of the measured run
    assert executed_share(1, False) == 1.0 and executed_share(2, False) == pytest.approx(7 / 6)
    assert executed_share(4, True) == pytest.approx(1 + (3 / 4 + 1) / 3)


def test_fp32_and_a_given_mfu_are_labelled():
    fp32 = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=256, precision="fp32")
    assert fp32.mfu == ASSUMED_MFU and fp32.mfu_source.startswith("assumed")
    given = P.make_plan("ViT-L-14", gpus=8, gpu_memory_gb=80, batch_size=1024, mfu=0.3)
    assert given.mfu == 0.3 and given.mfu_source == "given (--mfu)"


def test_the_cli_prints_the_figure_and_its_source(capsys):
    assert C.main_plan(["--model", "ViT-L-14", "--gpus", "8", "--global-batch", "1024"]) == 0
    out = capsys.readouterr().out
    assert "MFU 0.451: measured, ViT-L-14 ZeRO-2 bf16 micro-batch 128" in out and MEASURED[1].source in out


def test_zero3_rows_once_measured_are_used_and_scale_the_models_without_one():
    """What the next GPU lease adds (gpu_h200.sh stage zero3) changes the plans at once: a model's own
    ZeRO-3 row; for another model its ZeRO-2 figure times ZeRO-3's measured share on the nearest model
    measured at both; ZeRO-2 plans keep their ZeRO-2 rows. A stand-in table, not measurements."""
    from dsclip.plan.efficiency import MeasuredMFU, plan_mfu

    def row(model, zero, mfu):
        return MeasuredMFU(model, zero, "bf16", 64, 100.0, mfu, "H200", "stand-in")

    table = (row("ViT-B-32", 2, 0.30), row("ViT-L-14", 2, 0.45), row("ViT-L-14", 3, 0.36))
    gflops = {"ViT-B-32": 4.4, "ViT-L-14": 81.0}
    mfu, src = plan_mfu("ViT-L-14", 3, "bf16", 81.0, gflops, table)
    assert mfu == 0.36 and src.startswith("measured, ViT-L-14 ZeRO-3")
    mfu, src = plan_mfu("ViT-L-14", 2, "bf16", 81.0, gflops, table)
    assert mfu == 0.45 and "ZeRO-2" in src and "ZeRO-3" not in src
    # ViT-H-14 (167 GFLOPs) at ZeRO-3: the largest model's ZeRO-2 figure x ViT-L-14's measured 0.36 / 0.45
    mfu, src = plan_mfu("ViT-H-14", 3, "bf16", 167.0, gflops, table)
    assert mfu == pytest.approx(0.45 * 0.36 / 0.45, abs=1e-4)
    assert "the largest model measured" in src and "x 0.80, ZeRO-3's share" in src and "not measured" not in src
    # ViT-B-32 at ZeRO-3 has no ZeRO-3 row of its own: its ZeRO-2 figure, scaled the same way
    mfu, src = plan_mfu("ViT-B-32", 3, "bf16", 4.4, gflops, table)
    assert mfu == pytest.approx(0.30 * 0.8, abs=1e-4) and src.startswith("measured, ViT-B-32 ZeRO-2")
    # without any ZeRO-3 row: ZeRO-2's figure as it is, and the source says so
    mfu, src = plan_mfu("ViT-H-14", 3, "bf16", 167.0, gflops, table[:2])
    assert mfu == 0.45 and "ZeRO-3 is not measured on a GPU yet" in src
