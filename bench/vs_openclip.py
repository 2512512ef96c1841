"""dsclip vs open_clip_train, same OpenCLIP JSON architecture, same micro-batch, data and precision.

What is compared (one fresh process per measurement, implementations alternated in one invocation):
  openclip  ``open_clip_train.train.train_one_epoch`` (open_clip_torch 3.3.0, imported from this venv:
            the trainer module needs neither pandas nor webdataset; its data module does, so a
            synthetic in-memory dataloader stands in for ``get_data``), on ``open_clip.create_model``
            with torch AdamW (OpenCLIP's gain/bias exclusion) and ``open_clip.loss.ClipLoss``.
            Precisions: fp32, amp_bf16 (fp32 weights + autocast), pure_bf16 (bf16 weights, no master).
  dsclip    dsclip's training step as ``dsclip train`` runs it: ``build_engine`` (DeepSpeed ZeRO-2,
            torch AdamW handed to DeepSpeed) + ``GradCacheStep`` (accum 1) + the loop's per-step seed,
            on ``dsclip.model.create_model`` of the same JSON. Precisions: fp32 (ds_configs/
            zero2_fp32.json) and bf16 (zero2_bf16.json: bf16 weights + fp32 master in the optimizer).
            World 1 and world 2 (gloo; open_clip_train cannot run 2 processes on CPU: DDP is given
            device_ids=[cpu]).

Per measurement: build, ``--warmup`` steps, then ``--steps`` timed steps; samples/s over the timed
steps; peak RSS = the process's VmHWM (kernel high-water mark of resident memory, whole process:
weights, optimizer, activations). Threads: 1 per process (2 shared cores).

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/vs_openclip.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (the model, batches, timing loop, workers, alternation, ratios)


# ------------------------------------------------------------------------------------------------
# OpenCLIP
class Loader(list):
    """What ``train_one_epoch`` reads of open_clip_train's dataloader, over in-memory batches."""

    @property
    def num_batches(self):
        return len(self)

    @property
    def num_samples(self):
        return sum(b[0].shape[0] for b in self)


def openclip_model(cfg: dict, precision: str, device="cpu", name: str = H.MODEL_NAME, **kwargs):
    """``open_clip.create_model`` of the same architecture JSON dsclip builds from, registered as ``name``."""
    import open_clip
    import torch

    open_clip.add_model_config(str(H.write_model_json(cfg, name)))
    torch.manual_seed(0)
    return open_clip.create_model(name, precision=precision, device=device, output_dict=True, **kwargs)


def openclip_args(precision: str, batch: int, accum_freq: int = 1, rank: int = 0, world: int = 1, device="cpu"):
    """The argparse namespace ``train_one_epoch`` reads, as open_clip_train/main.py would fill it for this run
    (no scheduler, clipping, logging, wandb or checkpoints)."""
    return SimpleNamespace(
        device=str(device),
        precision=precision,
        accum_freq=accum_freq,
        distill=False,
        skip_scheduler=True,
        horovod=False,
        grad_clip_norm=None,
        log_every_n_steps=10**9,
        batch_size=batch,
        world_size=world,
        rank=rank,
        local_rank=rank,
        distributed=world > 1,
        wandb=False,
        save_logs=False,
    )


def openclip_epoch(model, loss, optimizer, args):
    """``epoch(batches)``: ``open_clip_train.train.train_one_epoch`` over in-memory ``batches``."""
    from open_clip_train.train import train_one_epoch

    def epoch(batches):
        data = {"train": SimpleNamespace(dataloader=Loader(batches), set_epoch=lambda e: None)}
        train_one_epoch(model, data, loss, 0, optimizer, None, None, None, args)

    return epoch


def openclip_trainer(
    precision: str,
    batch: int,
    cfg: dict = H.BENCH_CFG,
    accum_freq: int = 1,
    patch_dropout: float | None = None,
    rank: int = 0,
    world: int = 1,
):
    """``epoch(batches)``: ``open_clip_train.train.train_one_epoch`` over ``batches``, set up as
    open_clip_train/main.py sets it up: OpenCLIP's own model from the same config, AdamW without weight
    decay on gains/biases/logit_scale, and at world > 1 the model in DDP (main.py's wrap without its
    ``device_ids=[device]``, which fails on CPU) with the exact multi-rank loss (--local-loss
    --gather-with-grad)."""
    import logging

    import torch
    from open_clip.loss import ClipLoss

    model = openclip_model(cfg, precision, force_patch_dropout=patch_dropout)
    # open_clip_train/main.py: no weight decay on gains, biases and logit_scale
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if exclude(n, p) and p.requires_grad], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exclude(n, p) and p.requires_grad], "weight_decay": 0.2},
        ],
        lr=5e-4,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    loss = ClipLoss(local_loss=world > 1, gather_with_grad=world > 1, cache_labels=True, rank=rank, world_size=world)
    logging.disable(logging.INFO)
    return openclip_epoch(model, loss, optimizer, openclip_args(precision, batch, accum_freq, rank, world))


def openclip_worker(
    precision: str,
    batch: int,
    warmup: int,
    steps: int,
    cfg: dict = H.BENCH_CFG,
    accum_freq: int = 1,
    patch_dropout: float | None = None,
) -> dict:
    H.one_thread()
    epoch = openclip_trainer(precision, batch, cfg, accum_freq, patch_dropout)
    return H.timed_run(lambda data, n0: epoch(data), batch, warmup, steps, cfg, accum_freq)


# ------------------------------------------------------------------------------------------------
# orchestration: each measurement in a fresh interpreter of this script, alternating


def worker_main(spec: dict) -> None:
    impl = spec.pop("impl")
    fn = openclip_worker if impl == "openclip" else H.dsclip_worker
    H.emit_result(fn(**spec))


def run_worker(spec: dict, timeout: int = 1800) -> dict:
    return H.run_worker(spec, __file__, timeout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    H.common_args(ap, worker=True, batch=32, warmup=2, steps=8, rounds=3)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--no-world2", action="store_true", help="leave out dsclip's world-2 rows")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
    print(H.preamble(__file__), flush=True)
    common = {"batch": a.batch, "warmup": a.warmup, "steps": a.steps}
    rows = []
    for prec in a.precisions.split(","):
        if prec == "fp32":
            specs = {
                "openclip fp32": {"impl": "openclip", "precision": "fp32", **common},
                "dsclip fp32 (ZeRO-2)": {"impl": "dsclip", "precision": "fp32", **common},
            }
        else:
            specs = {
                "openclip amp_bf16": {"impl": "openclip", "precision": "amp_bf16", **common},
                "openclip pure_bf16": {"impl": "openclip", "precision": "pure_bf16", **common},
                "dsclip bf16 (ZeRO-2)": {"impl": "dsclip", "precision": "bf16", **common},
            }
        if not a.no_world2:
            specs[f"dsclip {prec} (ZeRO-2) world 2"] = {
                "impl": "dsclip",
                "precision": prec,
                "world": 2,
                **common,
            }
        print(f"== {prec}: batch {a.batch}/process, {a.steps} timed steps, {a.rounds} rounds", flush=True)
        res = H.alternate(specs, a.rounds, run_worker)
        summ = {n: H.summarize(v) for n, v in res.items()}
        base = next(v for n, v in summ.items() if n.startswith("openclip"))
        for n, s in summ.items():
            wall, cpu = H.ratios(s, base)
            rows.append({"precision": prec, "run": n, **s, "ratio_vs_openclip": wall, "cpu_ratio_vs_openclip": cpu})
    print(
        "\n| precision | run | samples/s (median, min-max) | samples/CPU-s per process | peak RSS MB | "
        "ratio (wall) | ratio (CPU) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['precision']} | {r['run']} | {H.rate_cell(r)} | "
            f"{r['samples_per_cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['ratio_vs_openclip']:.2f} | "
            f"{r['cpu_ratio_vs_openclip']:.2f} |"
        )
    H.write_json(a.json_out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
