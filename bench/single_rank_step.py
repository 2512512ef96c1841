"""One rank: AdamW on the gradients where backward left them against the flat step, turn by turn.

dsclip/engine/single_rank_step.py: at one rank (fp32, dsclip's fused AdamW) the step reads every
parameter's gradient in place instead of a flat copy of all of them. This builds both engines in one rank
process (vs_openclip.dsclip_trainer: ZeRO-2 fp32, one thread, as `dsclip train` runs them; the flat one
with ``single_rank_step=False``) and lets them take turns of ``--steps`` steps, the order alternating each
round, so that both see the same machine seconds apart. Printed per model: each trainer's median CPU
time per step and the per-turn ratio flat / in place as median (min-max) over the rounds.

    OMP_NUM_THREADS=1 .venv/bin/python bench/single_rank_step.py --models demo --batch 32 --steps 10 --rounds 16
    OMP_NUM_THREADS=1 .venv/bin/python bench/single_rank_step.py --models ViT-B-32 --batch 8 --steps 1 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRAINERS = ("flat", "in place")


def _rank(rank, world, model, batch, warmup, steps, rounds):
    import vs_openclip as V

    from dsclip.model import get_model_config

    V.one_thread()
    cfg = get_model_config(model)
    runs = {name: V.dsclip_trainer(rank, world, "fp32", batch, cfg, opts={"single_rank_step": name == "in place"})
            for name in TRAINERS}  # fmt: skip
    data = V.synthetic_batches(steps, batch, cfg, seed=2)
    taken = dict.fromkeys(TRAINERS, 0)
    for name, run in runs.items():  # the first step creates the optimizer state (the flat step for both)
        run(V.synthetic_batches(warmup, batch, cfg, seed=1), 0)
        taken[name] = warmup
    per_step = {name: [] for name in TRAINERS}
    for r in range(rounds):
        for name in TRAINERS if r % 2 == 0 else TRAINERS[::-1]:
            c0 = time.process_time()
            runs[name](data, taken[name])
            per_step[name].append((time.process_time() - c0) / steps)
            taken[name] += steps
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps per turn")
    ap.add_argument("--rounds", type=int, default=16)
    a = ap.parse_args()
    from tests.distutil import run_world

    for model in a.models.split(","):
        per_step = run_world(_rank, 1, model, a.batch, a.warmup, a.steps, a.rounds)[0]
        ratios = [f / p for f, p in zip(per_step["flat"], per_step["in place"])]
        med = {n: statistics.median(v) for n, v in per_step.items()}
        print(
            f"{model}, micro-batch {a.batch}, one rank, {a.rounds} turns of {a.steps} steps each: "
            f"flat {med['flat'] * 1e3:.1f} / in place {med['in place'] * 1e3:.1f} CPU-ms per step; "
            f"flat / in place per turn {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
