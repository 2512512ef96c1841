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
* ZeRO-3 was not yet measured on a GPU: ZeRO-2's figure is used and the plan says so (on CPU,
  bench/results/zero3-host_cpu2_2026-12-03.md measured ZeRO-3's host time per step at 2.8x ZeRO-2's; a
  GPU hides that only while a step's arithmetic outlasts it);
* fp32 has no measurement: the assumed figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ASSUMED_MFU = 0.4


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


def plan_mfu(
    model: str, zero: int, precision: str, forward_gflops: float, measured_gflops: dict[str, float]
) -> tuple[float, str]:
    """(MFU, where it comes from) for a plan. ``measured_gflops`` maps each measured architecture to its
    forward GFLOPs per sample (computed by the planner, so the comparison uses one FLOP count)."""
    if precision == "fp32":
        return ASSUMED_MFU, f"assumed {ASSUMED_MFU:g} (no fp32 measurement; give --mfu)"
    rows = [m for m in MEASURED if m.precision in ("bf16", "fp16")]
    same = [m for m in rows if m.model == model]
    stage_note = ""
    if zero == 3:
        stage_note = "; ZeRO-3 is not measured on a GPU yet, so this is ZeRO-2's figure (the ZeRO-3 step may be slower)"
    exact = [m for m in same if m.zero == zero or zero == 3]
    if exact:
        return exact[0].mfu, f"measured, {exact[0].describe()}{stage_note}"
    largest = max(rows, key=lambda m: measured_gflops[m.model])
    if forward_gflops >= measured_gflops[largest.model]:
        pick, how = largest, "the largest model measured"
    else:
        pick = min(rows, key=lambda m: abs(math.log(measured_gflops[m.model] / forward_gflops)))
        how = "the measured model nearest in FLOPs per sample"
    return pick.mfu, (
        f"from {how}, {pick.describe()}; {model} is {forward_gflops:.0f} against "
        f"{measured_gflops[pick.model]:.0f} forward GFLOPs per sample{stage_note}"
    )
