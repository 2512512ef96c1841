"""The model-FLOPs utilisation ``dsclip plan`` predicts step times with: measured where dsclip has a
measurement, and saying which one; assumed (0.4) only where nothing was measured.

Each figure is a row of a results file in bench/results/ (tests/unit/test_plan_efficiency.py reads the
file and checks the number here against it). MFU = 3 x forward FLOPs x samples/s / the bf16 dense
GEMM peak measured on that GPU (790 TFLOP/s on the H200), the convention of bench/gpu_bench.py and of
the planner.

How a figure is chosen for a plan:
* the same architecture measured at the same ZeRO stage and a 16-bit precision: that figure;
* otherwise the measured architecture nearest in forward FLOPs per sample (MFU grows with a model's
  GEMM sizes: ViT-B-32 28.8 %, ViT-L-14 45.1 %); a larger model than any measured takes the largest's
  figure, which its bigger GEMMs usually exceed (so the prediction errs slow);
* ZeRO-3: the model's own ZeRO-3 row; else its ZeRO-2 figure scaled by ZeRO-3's measured share of
  ZeRO-2's MFU on the nearest model measured at both (bench/gpu_bench.py's zero3 trainers, gpu_h200.sh
  stage ``zero3``); while no ZeRO-3 row exists (none yet), ZeRO-2's figure as it is, and the plan says so
  (on CPU, bench/results/zero3-host_cpu2_2026-12-03.md measured ZeRO-3's host time per step at 2.8x
  ZeRO-2's; a GPU hides that only while a step's arithmetic outlasts it);
* fp32 has no measurement: the assumed figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ASSUMED_MFU = 0.4
NO_ZERO3_NOTE = "; ZeRO-3 is not measured on a GPU yet, so this is ZeRO-2's figure (the ZeRO-3 step may be slower)"


@dataclass(frozen=True)
class MeasuredMFU:
    model: str
    zero: int
    precision: str
    micro_batch: int
    samples_per_s: float
    mfu: float
    gpu: str
    source: str  # bench/results/ file holding the row

    def describe(self) -> str:
        return (
            f"{self.model} ZeRO-{self.zero} {self.precision} micro-batch {self.micro_batch}: {self.mfu:.1%} "
            f"({self.samples_per_s:,.0f} samples/s on one {self.gpu}, {self.source})"
        )


MEASURED: tuple[MeasuredMFU, ...] = (
    MeasuredMFU("ViT-B-32", 2, "bf16", 512, 5043, 0.288, "H200", "bench/results/gpu-h200_h200_2026-12-01.md"),
    MeasuredMFU("ViT-L-14", 2, "bf16", 128, 675, 0.451, "H200", "bench/results/gpu-h200_h200_2026-12-01.md"),
)


def _base_figure(rows, model: str, forward_gflops: float, measured_gflops: dict[str, float]) -> tuple[MeasuredMFU, str]:
    """The row a plan of ``model`` takes among ``rows`` and how it was chosen ("" for the model's own)."""
    same = [m for m in rows if m.model == model]
    if same:
        return same[0], ""
    largest = max(rows, key=lambda m: measured_gflops[m.model])
    if forward_gflops >= measured_gflops[largest.model]:
        return largest, "the largest model measured"
    nearest = min(rows, key=lambda m: abs(math.log(measured_gflops[m.model] / forward_gflops)))
    return nearest, "the measured model nearest in FLOPs per sample"


def plan_mfu(
    model: str,
    zero: int,
    precision: str,
    forward_gflops: float,
    measured_gflops: dict[str, float],
    measured: tuple[MeasuredMFU, ...] | None = None,
) -> tuple[float, str]:
    """(MFU, where it comes from) for a plan. ``measured_gflops`` maps each measured architecture to its
    forward GFLOPs per sample (computed by the planner, so the comparison uses one FLOP count);
    ``measured``: the table (default :data:`MEASURED`).

    ZeRO-3: the model's own ZeRO-3 row where there is one; else its ZeRO-1/2 figure (as for ZeRO-2) times
    ZeRO-3's measured share of ZeRO-2's MFU on the measured model nearest in FLOPs that has both; else
    the ZeRO-2 figure as it is, and the source says ZeRO-3 was not measured."""
    if precision == "fp32":
        return ASSUMED_MFU, f"assumed {ASSUMED_MFU:g} (no fp32 measurement; give --mfu)"
    rows = [m for m in (MEASURED if measured is None else measured) if m.precision in ("bf16", "fp16")]
    zero3 = [m for m in rows if m.zero == 3]
    if zero == 3:
        own = [m for m in zero3 if m.model == model]
        if own:
            return own[0].mfu, f"measured, {own[0].describe()}"
    base = [m for m in rows if m.zero in (1, 2)]
    pick, how = _base_figure(base, model, forward_gflops, measured_gflops)
    mfu = pick.mfu
    source = f"measured, {pick.describe()}" if not how else (
        f"from {how}, {pick.describe()}; {model} is {forward_gflops:.0f} against "
        f"{measured_gflops[pick.model]:.0f} forward GFLOPs per sample"
    )  # fmt: skip
    if zero == 3:
        pairs = [(z, b) for z in zero3 for b in base if b.model == z.model]
        if pairs:
            z, b = min(pairs, key=lambda zb: abs(math.log(measured_gflops[zb[0].model] / forward_gflops)))
            share = z.mfu / b.mfu
            mfu = round(mfu * share, 4)
            source += f"; x {share:.2f}, ZeRO-3's share of ZeRO-2's MFU measured on {z.model} ({z.describe()})"
        else:
            source += NO_ZERO3_NOTE
    return mfu, source
