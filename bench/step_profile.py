"""cProfile of dsclip's training step on one rank: where the CPU time of a gradient-cache step goes.

Builds the engine as bench/utilisation.py does (``build_engine`` + ``GradCacheStep``, ZeRO-2 fp32, one
thread per rank, the model ``--model`` on synthetic batches), runs ``--world`` gloo ranks, and prints
rank 0's profile (process CPU time, so the machine's load stays out) of ``--steps`` steps after two
untimed ones, sorted by ``--sort``. ``--deepspeed-flush`` keeps DeepSpeed's own coalesced flush (the
reference dsclip/engine/patches/local_flush.py replaces), to profile the two side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_profile.py --model ViT-B-32 --world 2 --batch 8 --steps 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vs_openclip as V  # noqa: E402

from dsclip.model import get_model_config  # noqa: E402


def _rank(rank, world, model, batch, accum, steps, sort, lines, local_flush):
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    V.one_thread()
    cfg = V.BENCH_CFG if model == "bench" else get_model_config(model)
    engine, _, _ = V.dsclip_engine(
        "fp32", batch, accum, cfg, world, {"engine_patches": "all" if local_flush else "none"}
    )
    loss = build_loss("infonce")
    step = GradCacheStep(engine, lambda *a: loss(*a), accum_freq=accum)
    data = V.synthetic_batches((steps + 2) * accum, batch, cfg, seed=3 + rank)
    engine.train()
    step(data[:accum])
    step(data[accum : 2 * accum])
    prof = cProfile.Profile(time.process_time)
    start = time.process_time()
    prof.enable()
    for i in range(steps):
        step(data[(2 + i) * accum : (3 + i) * accum], grad_norm=False)  # between logged steps, as most are
    prof.disable()
    per_step = (time.process_time() - start) / steps
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(lines)
    head = f"{model}, world {world}, micro-batch {batch} x K {accum}: {per_step:.4f} CPU-s per step (rank {rank})"
    return head + "\n" + out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="ViT-B-32", help="a model name, or bench (bench/vs_openclip.py's BENCH_CFG)")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum-freq", type=int, default=1, help="K micro-batches per step (the gradient cache)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--lines", type=int, default=30)
    ap.add_argument("--deepspeed-flush", action="store_true", help="DeepSpeed's own flush (the reference)")
    args = ap.parse_args()
    from dsclip.testing.gloo_world import run_world

    out = run_world(
        _rank,
        args.world,
        args.model,
        args.batch,
        args.accum_freq,
        args.steps,
        args.sort,
        args.lines,
        not args.deepspeed_flush,
    )
    print(out[0])


if __name__ == "__main__":
    main()
