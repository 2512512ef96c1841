"""What each engine patch (dsclip/engine/patches/) buys in host time: patched and stock steps, one process.

Host-side cost only, as the brief asks of CPU measurements: a thin model with ViT-B-32's tensor count
(its 12 + 12 blocks, width 64, so the arithmetic is small and a step is mostly per-tensor bookkeeping,
the part a GPU waits for), bf16 (where the overflow check acts), the gradient cache at K = 2. Every rank
builds one engine per selection (``--engine-patches`` values: all, none, and all-but-one for each patch
that applies at that world size) and steps them in turn, the order rotated every step; CPU seconds per
step (``time.process_time``), median over the steps. Ratios are stock/patched: > 1 means the patch saves.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/patches.py --world 1 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_openclip as V  # noqa: E402

PATCHES_AT = {
    1: ("local_flush", "overflow_check", "grad_hooks", "grad_norm"),
    2: ("overflow_check", "grad_hooks", "grad_norm"),
}


def thin_vit_b32() -> dict:
    from dsclip.model import get_model_config

    cfg = get_model_config("ViT-B-32")
    cfg["embed_dim"] = 64
    cfg["vision_cfg"].update(width=64, head_width=32, image_size=64)
    cfg["text_cfg"].update(width=64, heads=2, context_length=32, vocab_size=1000)
    return cfg


def _rank(rank, world, a):
    V.one_thread()
    cfg = thin_vit_b32()
    selections = {"all": "all", "none": "none"} | {f"all,-{p}": f"all,-{p}" for p in PATCHES_AT[world]}
    runs = {
        n: V.dsclip_trainer(rank, world, "bf16", a.batch, cfg, a.k, {"extra": {"engine_patches": s}})
        for n, s in selections.items()
    }
    data = V.synthetic_batches(a.k * 2, a.batch, cfg, seed=1 + rank)
    for run in runs.values():  # warm-up: optimizer states, allocator
        run(data[: a.k], 0)
        run(data[a.k :], 1)
    times = {n: [] for n in runs}
    names = list(runs)
    for s in range(a.steps):
        chunk = data[(s % 2) * a.k : (s % 2 + 1) * a.k]
        for n in names[s % len(names) :] + names[: s % len(names)]:
            c0 = time.process_time()
            runs[n](chunk, 2 + s)
            times[n].append(time.process_time() - c0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args(argv)
    from dsclip.testing.gloo_world import run_world

    ranks = run_world(_rank, a.world, a, timeout=3600)
    times = {n: [max(r[n][s] for r in ranks) for s in range(a.steps)] for n in ranks[0]}  # the slowest rank
    base = times["all"]
    print(
        f"thin ViT-B-32 (width 64, 24 blocks), bf16, world {a.world}, micro-batch {a.batch}, K = {a.k}, "
        f"{a.steps} steps each, CPU s per step\n"
    )
    print("| engine patches | CPU s / step (median) | vs all (median of per-step ratios) |")
    print("|---|---:|---:|")
    for n, t in times.items():
        r = statistics.median(x / b for x, b in zip(t, base))
        print(f"| {n} | {statistics.median(t):.4f} | {r:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
