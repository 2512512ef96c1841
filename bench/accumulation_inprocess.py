"""Gradient cache vs OpenCLIP-style accumulation at world 1, step by step in ONE process (CPU time).

bench/accumulation.py runs every method in its own process; on a machine shared with other jobs its
rounds differ by up to 3x. This puts the methods in one process and alternates them step by step, so
each step's CPU time (time.process_time) is measured under the same conditions; the ratio per
step pair is what is reported (median, min-max). Same model (BENCH_CFG), data, fp32, one thread,
micro-batch B, K micro-batches per step:

  dsclip          the shipped GradCacheStep on a DeepSpeed ZeRO-2 engine (one-copy flush at world 1:
                  dsclip/engine/patches/local_flush.py; BlockedAdamW: dsclip/engine/optim.py)
  dsclip-before   the same with DeepSpeed's own coalesced flush and torch's AdamW (this module's
                  state before issue 17 item 4)
  openclip-style  open_clip_train's accum_freq branch on the plain model with torch AdamW (as
                  bench/accumulation.py)

    env OMP_NUM_THREADS=1 .venv/bin/python bench/accumulation_inprocess.py --batch 8 --k 4 --steps 12
    ... --profile dsclip     # cProfile (CPU time) of that method's steps
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_openclip as V  # noqa: E402


def _rank(rank, world, a):
    import torch
    from open_clip.loss import ClipLoss

    from dsclip.engine.build import autocast_dtype
    from dsclip.engine.optim import param_groups
    from dsclip.losses import build_loss
    from dsclip.model import create_model
    from dsclip.train.gradcache import GradCacheStep

    V.one_thread()
    cfg, k = V.BENCH_CFG, a.k
    steps = {}
    for name, local in (("dsclip", True), ("dsclip-before", False)):
        engine, bundle, _ = V.dsclip_engine(
            "fp32", a.batch, k, cfg, world, {"engine_patches": "all" if local else "none"}
        )
        if not local:  # torch's AdamW over the flat partition, as before (same groups, hyperparameters)
            inner = engine.optimizer.optimizer
            torch_adamw = torch.optim.AdamW(inner.param_groups, foreach=False)
            torch_adamw.state = inner.state
            engine.optimizer.optimizer = torch_adamw
        fn = GradCacheStep(engine, build_loss("infonce"), accum_freq=k, compute_dtype=autocast_dtype(bundle))

        def ds_step(chunk, engine=engine, fn=fn):
            engine.train()
            fn(chunk)
            engine.get_lr()

        steps[name] = ds_step
    torch.manual_seed(0)
    model = create_model(cfg).train()
    opt = torch.optim.AdamW(param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    loss = ClipLoss(cache_labels=True)

    def oc_step(chunk):  # open_clip_train/train.py, accum_freq > 1 (as bench/accumulation.py)
        opt.zero_grad()
        acc = {}
        with torch.no_grad():
            for im, tx in chunk:
                o = model(image=im, text=tx)
                o.pop("logit_bias"), o.pop("logit_scale")
                for key, v in o.items():
                    acc.setdefault(key, []).append(v)
        for j, (im, tx) in enumerate(chunk):
            o = model(image=im, text=tx)
            o.pop("logit_bias")
            scale = o.pop("logit_scale")
            inputs = {key: torch.cat(v[:j] + [o[key]] + v[j + 1 :]) for key, v in acc.items()}
            loss(**inputs, logit_scale=scale).backward()
        opt.step()

    steps["openclip-style"] = oc_step
    data = V.synthetic_batches(2 * k, a.batch, cfg, seed=1)
    for _ in range(2):  # warm-up (first-touch of optimizer states, allocator)
        for f in steps.values():
            f(data[:k])
    names = list(steps)
    times = {n: [] for n in names}
    prof = cProfile.Profile(time.process_time)
    for s in range(a.steps):
        chunk = data[(s % 2) * k : (s % 2 + 1) * k]
        for n in names[s % len(names) :] + names[: s % len(names)]:  # rotate the order every step
            c0 = time.process_time()
            if n == a.profile:
                prof.enable()
            steps[n](chunk)
            if n == a.profile:
                prof.disable()
            times[n].append(time.process_time() - c0)
    out = io.StringIO()
    if a.profile:
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    return times, out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", default="", help="cProfile this method (dsclip, dsclip-before, openclip-style)")
    a = ap.parse_args(argv)
    from dsclip.testing.gloo_world import run_world

    ((times, prof),) = run_world(_rank, 1, a, timeout=3600)
    print(prof)
    oc = times["openclip-style"]
    print(f"world 1, micro-batch {a.batch}, K = {a.k}, {a.steps} steps per method, CPU s per step\n")
    print("| method | CPU s / step (median, min-max) | speed vs OpenCLIP-style per step pair (median, min-max) |")
    print("|---|---:|---:|")
    for n, t in times.items():
        r = [o / x for o, x in zip(oc, t)]
        print(
            f"| {n} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | "
            f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
