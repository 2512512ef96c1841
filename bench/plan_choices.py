"""What `dsclip plan` chooses for the big jobs: the chosen row and the fastest fitting ZeRO-2 and ZeRO-3 rows
without offload, as a markdown table (predictions of the planner; nothing runs).

    python bench/plan_choices.py   # bench/results/plan-choices_cpu2_2026-12-07.md

Each row is `dsclip plan --model MODEL --gpus N --gpu GPU --global-batch B`; the ZeRO-2/3 columns come from
the same search. ViT-e-30B.json is ViT-bigG-14's JSON with vision width 6656 and 48 layers (30 B parameters:
ZeRO-2 cannot hold it on 80 GB, ZeRO-3 can; tests/unit/test_plan_search.py's big-json case). EVA-18B-shape.json
is ViT-bigG-14's JSON with EVA-CLIP-18B's vision width 5120, 48 layers and MLP 13824 (mlp_ratio 2.7; a plain
MLP, not SwiGLU: 12.5 B parameters), planned on EVA-CLIP-18B's published hardware, 360 A100-40GB. Run from a
checkout, it plans with that checkout's planner (the results file compares two checkouts' runs).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsclip.cli import plan as C  # noqa: E402
from dsclip.model import get_model_config  # noqa: E402
from dsclip.plan import search as S  # noqa: E402


def describe(p) -> str:
    if p is None or not p.fits:
        return "does not fit"
    off = "" if p.offload == "none" else f", offload {p.offload}"
    ckpt = ", checkpointing" if p.grad_checkpointing else ""
    grads = f", grads {p.grad_reduction}" if getattr(p, "grad_reduction", "") and p.zero >= 2 else ""
    return (
        f"ZeRO-{p.zero}{off}{ckpt}{grads}, loss {p.loss}, micro-batch {p.micro_batch} x --accum-freq {p.accum_freq}: "
        f"{p.memory_gb['total']:.1f} GiB, {p.samples_per_s_per_gpu * p.gpus:,.0f} samples/s "
        f"({p.samples_per_s_per_gpu:.1f}/GPU)"
    )


def main() -> int:
    cfg = get_model_config("ViT-bigG-14")
    cfg["vision_cfg"].update(width=6656, layers=48)
    big = Path(tempfile.mkdtemp()) / "ViT-e-30B.json"
    big.write_text(json.dumps(cfg))
    eva = get_model_config("ViT-bigG-14")
    eva["vision_cfg"].update(width=5120, layers=48, head_width=128, mlp_ratio=2.7)
    eva_path = big.parent / "EVA-18B-shape.json"
    eva_path.write_text(json.dumps(eva))
    jobs = [("ViT-H-14", 32, "h100", 65536), ("ViT-bigG-14", 8, "h100", 32768), ("ViT-bigG-14", 8, "a100-40", 32768),
            ("ViT-bigG-14", 8, "l4", 32768), ("ViT-bigG-14", 256, "h100", 32768), ("ViT-bigG-14", 1, "l4", 256),
            (str(big), 8, "h100", 4096), (str(big), 32, "h100", 4096),
            (str(eva_path), 360, "a100-40", 108000)]  # fmt: skip
    found = []
    real = S.search  # plan_cli imports it at the call: the module attribute is what it gets

    def spy(*a, **k):
        found.append(real(*a, **k))
        return found[-1]

    S.search = spy
    print("| model | GPUs | global batch | chosen | fastest ZeRO-2 | fastest ZeRO-3 |")
    print("|---|---|---:|---|---|---|")
    for model, n, gpu, batch in jobs:
        with contextlib.redirect_stdout(io.StringIO()):
            C.main_plan(["--model", model, "--gpus", str(n), "--gpu", gpu, "--global-batch", str(batch)])
        s = found[-1]

        def fastest(z, s=s):
            return next((p for p in s.fitting if p.zero == z and p.offload == "none"), None)

        name = Path(model).name if model.endswith(".json") else model
        row = [name, f"{n} x {gpu}", str(batch), describe(s.chosen), describe(fastest(2)), describe(fastest(3))]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
