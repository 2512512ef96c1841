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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A ViT-B/32-shaped but narrower OpenCLIP architecture that trains at a few steps/s on one core.
BENCH_CFG = {
    "embed_dim": 256,
    "vision_cfg": {"image_size": 96, "layers": 6, "width": 256, "head_width": 64, "patch_size": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 1000, "width": 256, "heads": 4, "layers": 6},
}
MODEL_NAME = "dsclip-bench-S"


def write_model_json(cfg: dict = BENCH_CFG, name: str = MODEL_NAME) -> Path:
    """The model's OpenCLIP config file, in a directory of this process's own: open_clip.add_model_config
    rescans every file of the directory, and the ranks of one bench write theirs at the same moment (a
    shared directory had one rank read the other's half-written file)."""
    d = Path(tempfile.gettempdir()) / "dsclip-bench" / str(os.getpid())
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    p.write_text(json.dumps(cfg))
    return p


def synthetic_batches(n: int, batch: int, cfg: dict = BENCH_CFG, seed: int = 0):
    """Images (B,3,S,S) normal, tokens (B,L) with the EOT (largest id, OpenCLIP argmax pooling) at a
    random position and zeros after it: the same tensors for both trainers."""
    import torch

    g = torch.Generator().manual_seed(seed)
    s, length, vocab = (
        cfg["vision_cfg"]["image_size"],
        cfg["text_cfg"]["context_length"],
        cfg["text_cfg"]["vocab_size"],
    )
    out = []
    for _ in range(n):
        img = torch.randn(batch, 3, s, s, generator=g)
        tok = torch.randint(1, vocab - 1, (batch, length), generator=g)
        ends = torch.randint(4, length, (batch,), generator=g)
        for i, e in enumerate(ends.tolist()):
            tok[i, e] = vocab - 1
            tok[i, e + 1 :] = 0
        out.append((img, tok))
    return out


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark to the current RSS (Linux /proc/self/clear_refs <- 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def one_thread():
    import torch

    torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------
# OpenCLIP
class _Loader(list):
    @property
    def num_batches(self):
        return len(self)

    @property
    def num_samples(self):
        return sum(b[0].shape[0] for b in self)


def openclip_trainer(
    precision: str,
    batch: int,
    cfg: dict = BENCH_CFG,
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

    import open_clip
    import torch
    from open_clip.loss import ClipLoss
    from open_clip_train.train import train_one_epoch

    open_clip.add_model_config(str(write_model_json(cfg)))
    torch.manual_seed(0)
    model = open_clip.create_model(
        MODEL_NAME, precision=precision, device="cpu", force_patch_dropout=patch_dropout, output_dict=True
    )
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
    args = SimpleNamespace(
        device="cpu",
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
    logging.disable(logging.INFO)

    def epoch(batches):
        data = {"train": SimpleNamespace(dataloader=_Loader(batches), set_epoch=lambda e: None)}
        train_one_epoch(model, data, loss, 0, optimizer, None, None, None, args)

    return epoch


def openclip_worker(
    precision: str,
    batch: int,
    warmup: int,
    steps: int,
    cfg: dict = BENCH_CFG,
    accum_freq: int = 1,
    patch_dropout: float | None = None,
) -> dict:
    one_thread()
    epoch = openclip_trainer(precision, batch, cfg, accum_freq, patch_dropout)
    k = accum_freq
    epoch(synthetic_batches(warmup * k, batch, cfg, seed=1))
    data = synthetic_batches(steps * k, batch, cfg, seed=2)
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    epoch(data)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "samples_per_s": steps * k * batch / dt,
        "samples_per_cpu_s": steps * k * batch / cpu,
        "peak_rss_mb": peak_rss_mb(),
        "step_s": dt / steps,
    }


# ------------------------------------------------------------------------------------------------
# dsclip
def dsclip_engine(
    precision: str,
    batch: int,
    accum_freq: int,
    cfg: dict,
    world: int,
    extra: dict | None = None,
    ds_overrides: dict | None = None,
    model_kwargs: dict | None = None,
    grad_checkpointing=False,
    device_type="cpu",
):
    """(engine, bundle, run config) built exactly as dsclip/train/loop.py does."""
    import torch

    from dsclip.config import make_run_config
    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.model import create_model

    values = {
        "name": "bench",
        "model": str(write_model_json(cfg)),
        "batch_size": batch,
        "accum_freq": accum_freq,
        "precision": precision,
        "deepspeed_config": f"ds_configs/zero2_{precision}.json",
        "lr": 5e-4,
        "warmup": 0,
        "lr_scheduler": "const",
        "grad_checkpointing": grad_checkpointing,
    }
    values.update(extra or {})
    rc = make_run_config(values)
    ds = resolve_ds_config(
        load_ds_json(rc.train.deepspeed_config), rc.train, rc.optim, world_size=world, device_type=device_type
    )
    for k, v in (ds_overrides or {}).items():
        if isinstance(v, dict):
            ds.setdefault(k, {}).update(v)
        else:
            ds[k] = v

    def factory():
        torch.manual_seed(0)
        return create_model(cfg, **(model_kwargs or {}))

    bundle = build_engine(
        ds, rc.train, rc.optim, factory, total_steps=10**6, steps_per_epoch=10**6,
        grad_checkpointing=rc.model.grad_checkpointing,  # as loop.py passes it (the run config alone does nothing)
    )  # fmt: skip
    return bundle.engine, bundle, rc


def dsclip_trainer(rank, world, precision, batch, cfg, accum_freq=1, opts=None):
    """``run(data, n0)``: dsclip's steps over ``data`` (K micro-batches each; ``n0`` = steps already
    taken) as ``dsclip train`` runs them: ``build_engine`` + ``GradCacheStep``, each step seeded by
    ``step_seed``, the gradient norm taken on logged steps only. ``opts["extra"]`` takes run-config values
    (e.g. ``{"engine_patches": "none"}``: DeepSpeed's own paths)."""
    import torch

    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from dsclip.train.loop import step_seed
    from dsclip.train.metrics import LogArgs

    opts = opts or {}
    engine, bundle, rc = dsclip_engine(
        precision,
        batch,
        accum_freq,
        cfg,
        world,
        opts.get("extra"),
        opts.get("ds_overrides"),
        opts.get("model_kwargs"),
        opts.get("grad_checkpointing", False),
    )
    if opts.get("sdpa_math"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.MATH)
        ctx.__enter__()
    step_fn = GradCacheStep(
        engine,
        build_loss(opts.get("loss", "infonce")),
        keep_last_graph=opts.get("keep_last_graph", True),
        compute_dtype=autocast_dtype(bundle),
        accum_freq=accum_freq,
    )
    k = accum_freq
    log_every = LogArgs().log_every_n_steps  # as `dsclip train` logs (and so takes the gradient norm) by default

    def run(data, n0):
        for i in range(len(data) // k):
            torch.manual_seed(step_seed(0, n0 + i, rank))
            engine.train()
            step_fn(data[i * k : (i + 1) * k], grad_norm=(n0 + i + 1) % log_every == 0)
            engine.get_lr()

    return run


def _dsclip_rank(rank, world, precision, batch, warmup, steps, cfg, accum_freq, opts):
    one_thread()
    run = dsclip_trainer(rank, world, precision, batch, cfg, accum_freq, opts)
    k = accum_freq
    run(synthetic_batches(warmup * k, batch, cfg, seed=1 + 100 * rank), 0)
    data = synthetic_batches(steps * k, batch, cfg, seed=2 + 100 * rank)
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    run(data, warmup)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "samples_per_s": steps * k * batch * world / dt,
        "samples_per_cpu_s": steps * k * batch / cpu,
        "peak_rss_mb": peak_rss_mb(),
        "step_s": dt / steps,
    }


def dsclip_worker(
    precision: str,
    batch: int,
    warmup: int,
    steps: int,
    cfg: dict = BENCH_CFG,
    world: int = 1,
    accum_freq: int = 1,
    opts: dict | None = None,
) -> dict:
    from dsclip.testing.gloo_world import run_world

    return combine_ranks(run_world(_dsclip_rank, world, precision, batch, warmup, steps, cfg, accum_freq, opts))


def combine_ranks(res: list[dict]) -> dict:
    """One measurement from the ranks' results."""
    # throughput: the slowest rank's view (they run in lock-step); memory: the largest rank
    return {
        "samples_per_s": min(r["samples_per_s"] for r in res),
        # per process: samples this rank processed per CPU-second it used (robust to other load)
        "samples_per_cpu_s": min(r["samples_per_cpu_s"] for r in res),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in res),
        "step_s": max(r["step_s"] for r in res),
    }


# ------------------------------------------------------------------------------------------------
# orchestration: each measurement in a fresh interpreter, alternating
def run_worker(spec: dict, timeout: int = 1800) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    p = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker {spec} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def worker_main(spec: dict) -> None:
    fn = {"openclip": openclip_worker, "dsclip": dsclip_worker}[spec.pop("impl")]
    print("RESULT " + json.dumps(fn(**spec)), flush=True)


def alternate(specs: dict[str, dict], rounds: int, log=print, runner=None) -> dict[str, list[dict]]:
    """Run every spec once per round, rotating the order each round (ABAB... not AABB)."""
    names = list(specs)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            res = (runner or run_worker)(dict(specs[n]))
            out[n].append(res)
            log(
                f"  round {r + 1} {n}: {res['samples_per_s']:.2f} samples/s, {res['samples_per_cpu_s']:.2f} "
                f"samples/CPU-s, peak RSS {res['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    return out


def summarize(results: list[dict]) -> dict:
    sps = [r["samples_per_s"] for r in results]
    cps = [r.get("samples_per_cpu_s", float("nan")) for r in results]
    return {
        "samples_per_s": statistics.median(sps),
        "min": min(sps),
        "max": max(sps),
        "samples_per_cpu_s": statistics.median(cps),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--no-world2", action="store_true")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
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
        res = alternate(specs, a.rounds)
        summ = {n: summarize(v) for n, v in res.items()}
        base = next(v for n, v in summ.items() if n.startswith("openclip"))
        for n, s in summ.items():
            rows.append(
                {
                    "precision": prec,
                    "run": n,
                    **s,
                    "ratio_vs_openclip": s["samples_per_s"] / base["samples_per_s"],
                    "cpu_ratio_vs_openclip": s["samples_per_cpu_s"] / base["samples_per_cpu_s"],
                }
            )
    print(
        "\n| precision | run | samples/s (median, min-max) | samples/CPU-s per process | peak RSS MB | "
        "ratio (wall) | ratio (CPU) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['precision']} | {r['run']} | {r['samples_per_s']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
            f"{r['samples_per_cpu_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['ratio_vs_openclip']:.2f} | "
            f"{r['cpu_ratio_vs_openclip']:.2f} |"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
