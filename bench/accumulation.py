"""Gradient accumulation at equal effective batch: dsclip's gradient cache vs OpenCLIP's --accum-freq.

Same model (``bench/harness.py``'s BENCH_CFG built with ``dsclip.model.create_model``), same
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (data, workers, timing loop, alternation, ratios)


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
    H.one_thread()
    run = openclip_style_trainer(rank, world, batch, accum_freq, cfg)
    return H.timed_run(lambda data, n0: run(data), batch, warmup, steps, cfg, accum_freq, rank, world)


def openclip_style_worker(
    batch: int, accum_freq: int, warmup: int, steps: int, cfg: dict = H.BENCH_CFG, world: int = 1
) -> dict:
    from dsclip.testing.gloo_world import run_world

    return H.combine_ranks(run_world(_openclip_style_rank, world, batch, accum_freq, warmup, steps, cfg))


def worker_main(spec: dict) -> None:
    impl = spec.pop("impl")
    H.emit_result(openclip_style_worker(**spec) if impl == "openclip_style" else H.dsclip_worker(**spec))


def run_worker(spec: dict) -> dict:
    return H.run_worker(spec, __file__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    H.common_args(ap, worker=True, batch=16, warmup=1, steps=3, rounds=2)
    ap.add_argument("--ks", default="1,2,4,8", help="micro-batches per step K (the contrastive batch is B·K)")
    ap.add_argument("--world", type=int, default=1, help="ranks (gloo); samples/s is global")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
    print(H.preamble(__file__), flush=True)
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
        res = H.alternate(specs, a.rounds, run_worker)
        summ = {n: H.summarize(v) for n, v in res.items()}
        for n, s in summ.items():
            wall, cpu = H.ratios(s, summ["openclip-style"])
            # time per sample against one forward + backward of the whole batch: big batch / this
            t_wall, t_cpu = H.ratios(summ["big batch"], s) if "big batch" in summ else (1.0, 1.0)
            rows.append(
                {
                    "K": k, "method": n, **s, "ratio_vs_openclip": wall, "cpu_ratio_vs_openclip": cpu,
                    "cpu_time_per_sample_vs_big_batch": t_cpu, "time_per_sample_vs_big_batch": t_wall,
                }
            )  # fmt: skip
    print(
        "\n| K | effective batch | method | samples/s (median, min-max) | samples/CPU-s | peak RSS MB | "
        "vs OpenCLIP-style (wall / CPU) | time per sample vs big batch (wall / CPU) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['K']} | {a.batch * r['K'] * a.world} | {r['method']} | {H.rate_cell(r)} | "
            f"{r['samples_per_cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['ratio_vs_openclip']:.2f} / {r['cpu_ratio_vs_openclip']:.2f} | "
            f"{r['time_per_sample_vs_big_batch']:.2f} / {r['cpu_time_per_sample_vs_big_batch']:.2f} |"
        )
    H.write_json(a.json_out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
