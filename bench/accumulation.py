"""Gradient accumulation at equal effective batch: dsclip's gradient cache vs OpenCLIP's --accum-freq.

Same model (``bench/vs_openclip.py``'s BENCH_CFG built with ``dsclip.model.create_model``), same
synthetic data, fp32, one process, one thread; micro-batch B fixed, K in {1, 2, 4, 8}, so the
contrastive batch is B·K. Each measurement runs in a fresh process (peak RSS = VmHWM after a reset
following the warm-up), and the methods are alternated within each round.

  dsclip          ``GradCacheStep`` on a DeepSpeed engine (ZeRO-2 fp32, torch AdamW), keep_last_graph on:
                  K no-grad forwards, one loss over the K·B cached embeddings, K-1 re-forwards (the last
                  chunk's graph is kept) with one backward each, one step.
  dsclip-nokeep   the same with keep_last_graph off (K re-forwards).
  openclip        OpenCLIP's algorithm (open_clip_train/train.py, ``accum_freq > 1`` branch) line for line
                  on the same plain-PyTorch model with torch AdamW: cache features without grad, then for
                  each chunk re-forward it, splice its features into the cached ones and evaluate the full
                  ``open_clip.loss.ClipLoss`` on all K·B rows, backward each (K loss evaluations, K
                  backwards, logit_scale gradient counted K times, no RNG replay).
  big batch       dsclip with micro-batch B·K and K = 1 (one forward, one backward): the no-accumulation
                  reference for GradCache's overhead per sample.

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/accumulation.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_openclip as V  # noqa: E402  (bench helpers: data, workers, peak RSS, alternation)


def openclip_style_trainer(rank: int, world: int, batch: int, accum_freq: int, cfg: dict):
    """``run(data)``: OpenCLIP's training step (its --accum-freq algorithm at K > 1) on dsclip's model
    in DDP, K micro-batches of ``data`` per step."""
    import torch
    from open_clip.loss import ClipLoss

    from dsclip.engine.optim import param_groups
    from dsclip.model import create_model

    torch.manual_seed(0)
    model = create_model(cfg).train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    if world > 1:
        # open_clip_train/main.py wraps the model in DDP (on CPU without its device_ids=[cpu] bug) and the
        # exact multi-rank loss is --local-loss --gather-with-grad. Its accum_freq branch does not use
        # no_sync(), so every one of the K backwards all-reduces the full gradient.
        model = torch.nn.parallel.DistributedDataParallel(model)
        loss = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world)
    else:
        loss = ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=True, rank=0, world_size=1)
    k = accum_freq

    def forward(images, texts):
        out = model(image=images, text=texts)  # dict: image_features, text_features, logit_scale, logit_bias
        out.pop("logit_bias")
        return out

    def step(chunk):
        # --- open_clip_train/train.py, accum_freq > 1 (accum_freq == 1: the plain branch) ---
        optimizer.zero_grad()
        if k == 1:
            images, texts = chunk[0]
            model_out = forward(images, texts)
            total_loss = loss(**model_out)
            total_loss.backward()
        else:
            accum_features = {}
            with torch.no_grad():
                for images, texts in chunk:
                    model_out = forward(images, texts)
                    model_out.pop("logit_scale", None)
                    for key, val in model_out.items():
                        accum_features.setdefault(key, []).append(val)
            for j, (images, texts) in enumerate(chunk):
                model_out = forward(images, texts)
                inputs_no_accum = {"logit_scale": model_out.pop("logit_scale")}
                inputs = {}
                for key, accumulated in accum_features.items():
                    inputs[key] = torch.cat(accumulated[:j] + [model_out[key]] + accumulated[j + 1 :])
                total_loss = loss(**inputs, **inputs_no_accum)
                del inputs, inputs_no_accum
                total_loss.backward()
        optimizer.step()

    def run(data):
        for i in range(len(data) // k):
            step(data[i * k : (i + 1) * k])

    return run


def _openclip_style_rank(rank: int, world: int, batch: int, accum_freq: int, warmup: int, steps: int, cfg: dict):
    V.one_thread()
    run = openclip_style_trainer(rank, world, batch, accum_freq, cfg)
    k = accum_freq
    run(V.synthetic_batches(warmup * k, batch, cfg, seed=1 + 100 * rank))
    data = V.synthetic_batches(steps * k, batch, cfg, seed=2 + 100 * rank)
    V.reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    run(data)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "samples_per_s": steps * k * batch * world / dt,
        "samples_per_cpu_s": steps * k * batch / cpu,
        "peak_rss_mb": V.peak_rss_mb(),
        "step_s": dt / steps,
    }


def openclip_style_worker(
    batch: int, accum_freq: int, warmup: int, steps: int, cfg: dict = V.BENCH_CFG, world: int = 1
) -> dict:
    from dsclip.testing.gloo_world import run_world

    return V.combine_ranks(run_world(_openclip_style_rank, world, batch, accum_freq, warmup, steps, cfg))


def worker_main(spec: dict) -> None:
    impl = spec.pop("impl")
    if impl == "openclip_style":
        res = openclip_style_worker(**spec)
    else:
        res = V.dsclip_worker(**spec)
    print("RESULT " + json.dumps(res), flush=True)


def run_worker(spec: dict) -> dict:
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(V.ROOT))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(V.ROOT / ".cache" / "torch_extensions"))
    p = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        cwd=V.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker {spec} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=16, help="micro-batch B")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world", type=int, default=1, help="ranks (gloo); samples/s is global")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
    rows = []
    for k in [int(x) for x in a.ks.split(",")]:
        common = {"warmup": a.warmup, "steps": a.steps, "world": a.world}
        specs = {
            "dsclip": {
                "impl": "dsclip",
                "precision": "fp32",
                "batch": a.batch,
                "accum_freq": k,
                "opts": {"keep_last_graph": True},
                **common,
            },
            "openclip-style": {"impl": "openclip_style", "batch": a.batch, "accum_freq": k, **common},
        }
        if k > 1:
            specs["dsclip-nokeep"] = {
                "impl": "dsclip",
                "precision": "fp32",
                "batch": a.batch,
                "accum_freq": k,
                "opts": {"keep_last_graph": False},
                **common,
            }
            specs["big batch"] = {
                "impl": "dsclip",
                "precision": "fp32",
                "batch": a.batch * k,
                "accum_freq": 1,
                **common,
            }
        print(f"== K={k}: micro-batch {a.batch}, world {a.world}, effective batch {a.batch * k * a.world}", flush=True)
        res = V.alternate(specs, a.rounds, runner=run_worker)
        summ = {n: V.summarize(v) for n, v in res.items()}
        for n, s in summ.items():
            rows.append(
                {
                    "K": k,
                    "method": n,
                    **s,
                    "ratio_vs_openclip": s["samples_per_s"] / summ["openclip-style"]["samples_per_s"],
                    "cpu_ratio_vs_openclip": s["samples_per_cpu_s"] / summ["openclip-style"]["samples_per_cpu_s"],
                    "cpu_time_per_sample_vs_big_batch": (
                        summ["big batch"]["samples_per_cpu_s"] / s["samples_per_cpu_s"] if "big batch" in summ else 1.0
                    ),
                    "time_per_sample_vs_big_batch": (
                        summ["big batch"]["samples_per_s"] / s["samples_per_s"] if "big batch" in summ else 1.0
                    ),
                }
            )
    print(
        "\n| K | effective batch | method | samples/s (median, min-max) | samples/CPU-s | peak RSS MB | "
        "vs OpenCLIP-style (wall / CPU) | time per sample vs big batch (wall / CPU) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['K']} | {a.batch * r['K'] * a.world} | {r['method']} | {r['samples_per_s']:.2f} ({r['min']:.2f}-"
            f"{r['max']:.2f}) | {r['samples_per_cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['ratio_vs_openclip']:.2f} / {r['cpu_ratio_vs_openclip']:.2f} | "
            f"{r['time_per_sample_vs_big_batch']:.2f} / {r['cpu_time_per_sample_vs_big_batch']:.2f} |"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
