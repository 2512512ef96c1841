"""What the bench scripts share: models and batches, memory and device readings, the engine as `dsclip train`
builds it, the timed-steps loop, one measurement per fresh interpreter, the alternation of trainers, their
side-by-side ratios, the common flags and the result file's name and preamble.

A script runs as ``python bench/SCRIPT.py`` from the repository root and imports this module as
``import harness as H`` (bench/ is the script's own folder, so it is on ``sys.path``); importing it puts the
repository root there too. The comparison with open_clip_train itself is bench/vs_openclip.py's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------------
# models and batches

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


def thin_config(name: str, width: int, image_size: int, context_length: int) -> dict:
    """``name``'s blocks (its tensor count) at ``width``, so that the arithmetic is small and a step is mostly
    the engine's per-tensor bookkeeping: the host time a GPU waits for."""
    from dsclip.model import get_model_config

    cfg = get_model_config(name)
    cfg["embed_dim"] = width
    cfg["vision_cfg"].update(width=width, head_width=width // 2, image_size=image_size)
    cfg["text_cfg"].update(width=width, heads=2, context_length=context_length, vocab_size=1000)
    return cfg


def synthetic_batches(n: int, batch: int, cfg: dict = BENCH_CFG, seed: int = 0):
    """Images (B,3,S,S) normal, tokens (B,L) with the EOT (largest id, OpenCLIP argmax pooling) at a
    random position and zeros after it: the same tensors for every trainer."""
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


def make_batches(cfg: dict, bs: int, n: int, dev):
    """``n`` batches of ``bs`` on ``dev`` for a real model's config (its context length and vocabulary), the EOT
    at position 20: what the GPU benches feed both trainers."""
    import torch

    s = cfg["vision_cfg"]["image_size"]
    ctx, vocab = cfg["text_cfg"].get("context_length", 77), cfg["text_cfg"].get("vocab_size", 49408)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        img = torch.randn(bs, 3, s, s, generator=g).to(dev)
        tok = torch.randint(1, vocab - 1, (bs, ctx), generator=g)
        end = min(20, ctx - 1)
        tok[:, end] = vocab - 1  # EOT (argmax pooling in OpenCLIP's text tower)
        tok[:, end + 1 :] = 0
        out.append((img, tok.to(dev)))
    return out


def train_flops_per_sample(cfg: dict) -> float:
    """Model FLOPs of one training sample: ``FlopCounterMode`` over one forward (math SDPA: the counter has no
    formula for the CPU flash kernel) times 3 (forward + backward), the MFU convention."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from dsclip.model import create_model

    model = create_model(cfg).eval()
    batch = synthetic_batches(1, 2, cfg, seed=0)[0]
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(image=batch[0], text=batch[1])
    return 3 * fc.get_total_flops() / 2


# ------------------------------------------------------------------------------------------------
# this process: memory, threads, device


def proc_status_kb(field: str) -> int:
    """A /proc/self/status field in kB (VmHWM: the kernel's high-water mark of resident memory, VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: weights, optimizer, activations, everything)."""
    return proc_status_kb("VmHWM") / 1024


def rss_mb() -> float:
    return proc_status_kb("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark to the current RSS (Linux /proc/self/clear_refs <- 5); False where the
    kernel does not allow it (the peak is then the process's lifetime maximum)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def one_thread() -> None:
    """One intra-op thread per process: the ranks of a CPU bench share the machine's cores."""
    import torch

    torch.set_num_threads(1)


def single_rank_env(port: int) -> None:
    """The rendezvous variables of a one-rank job, where the caller has not set them (as the launcher would)."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("LOCAL_RANK", "0")


def sync(dev) -> None:
    """Wait for the device (a CUDA stream runs ahead of the host; a CPU is done when the call returns)."""
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_mem_gb(dev) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")


def reset_mem(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed_on_device(run, cfg: dict, bs: int, steps: int, dev, warmup: int = 2) -> tuple[float, float]:
    """``run(batches, timed)`` on ``warmup`` untimed batches of ``bs``, then on ``steps`` timed ones (made on
    ``dev`` before the clock starts): samples/s and the device's peak memory over the timed steps (GiB)."""
    run(make_batches(cfg, bs, warmup, dev), False)
    sync(dev)
    reset_mem(dev)
    batches = make_batches(cfg, bs, steps, dev)
    sync(dev)
    t = time.perf_counter()
    run(batches, True)
    sync(dev)
    return steps * bs / (time.perf_counter() - t), peak_mem_gb(dev)


def bf16_peak_tflops(dev) -> float:
    """The device's dense bf16 GEMM rate (8192^3 products on a GPU, 512^3 on a CPU): the MFU's denominator."""
    import torch

    n = 8192 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    sync(dev)
    reps = 20 if dev.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


# ------------------------------------------------------------------------------------------------
# dsclip's step, as `dsclip train` runs it


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
    """(engine, bundle, run config) built exactly as dsclip/train/loop.py does: the run config from
    ``extra``'s values over the bench's (ZeRO-2 of ``precision``), the shipped JSON resolved for ``world``,
    then ``ds_overrides`` merged into it."""
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


def timed_run(run, batch: int, warmup: int, steps: int, cfg: dict, k: int = 1, rank: int = 0, world: int = 1) -> dict:
    """``run(data, n0)`` over ``warmup`` untimed steps, then ``steps`` timed ones, ``k`` micro-batches of
    ``batch`` each (this rank's own synthetic batches). samples/s: the job's (``world`` ranks in lock-step);
    samples per CPU-second: this process's (robust to other load); peak RSS over the timed steps."""
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


def _dsclip_rank(rank, world, precision, batch, warmup, steps, cfg, accum_freq, opts):
    one_thread()
    run = dsclip_trainer(rank, world, precision, batch, cfg, accum_freq, opts)
    return timed_run(run, batch, warmup, steps, cfg, accum_freq, rank, world)


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
    """One measurement of dsclip's step on ``world`` gloo ranks (fresh processes), combined."""
    from dsclip.testing.gloo_world import run_world

    return combine_ranks(run_world(_dsclip_rank, world, precision, batch, warmup, steps, cfg, accum_freq, opts))


def combine_ranks(res: list[dict]) -> dict:
    """One measurement from the ranks' results: throughput the slowest rank's view (they run in lock-step),
    memory the largest rank's."""
    return {
        "samples_per_s": min(r["samples_per_s"] for r in res),
        "samples_per_cpu_s": min(r["samples_per_cpu_s"] for r in res),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in res),
        "step_s": max(r["step_s"] for r in res),
    }


# ------------------------------------------------------------------------------------------------
# orchestration: each measurement in a fresh interpreter, the trainers alternated

RESULT = "RESULT "


def emit_result(res) -> None:
    """The worker's side of :func:`run_worker`: its result as one line on stdout."""
    print(RESULT + json.dumps(res), flush=True)


def run_worker(spec: dict, script: str, timeout: float = 3600, env: dict | None = None) -> dict:
    """``python SCRIPT --worker SPEC`` in a fresh interpreter (one thread, the repository root as its working
    directory and path), and the result it emits: no measurement inherits another's heap, threads or
    allocator state."""
    full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    full.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    p = subprocess.run(
        [sys.executable, str(script), "--worker", json.dumps(spec)],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"worker {spec} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def alternate(specs: dict[str, dict], rounds: int, runner, log=print) -> dict[str, list[dict]]:
    """``runner(spec)`` for every spec once per round, rotating the order each round (ABAB... not AABB), so
    the machine's load drifts hit every trainer alike."""
    names = list(specs)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            res = runner(dict(specs[n]))
            out[n].append(res)
            log(
                f"  round {r + 1} {n}: {res['samples_per_s']:.2f} samples/s, {res['samples_per_cpu_s']:.2f} "
                f"samples/CPU-s, peak RSS {res['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    return out


def summarize(results: list[dict]) -> dict:
    """A trainer's rounds: medians (and the wall rate's range)."""
    sps = [r["samples_per_s"] for r in results]
    cps = [r.get("samples_per_cpu_s", float("nan")) for r in results]
    return {
        "samples_per_s": statistics.median(sps),
        "min": min(sps),
        "max": max(sps),
        "samples_per_cpu_s": statistics.median(cps),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
    }


def rate_cell(s: dict, fmt: str = ".2f") -> str:
    """A summary's wall rate as a table cell: the median and the rounds' range."""
    return f"{s['samples_per_s']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def ratios(s: dict, base: dict) -> tuple[float, float]:
    """``s`` against ``base`` side by side: (wall samples/s ratio, samples per CPU-second ratio)."""
    return s["samples_per_s"] / base["samples_per_s"], s["samples_per_cpu_s"] / base["samples_per_cpu_s"]


# ------------------------------------------------------------------------------------------------
# flags, output and the result file

COMMON_FLAGS = {
    "batch": "micro-batch per process (rank)",
    "warmup": "untimed steps before the timed ones",
    "steps": "timed steps per measurement",
    "rounds": "rounds; the trainers alternate within each",
}


def common_args(ap: argparse.ArgumentParser, *, json_out=True, worker=False, **defaults: int) -> None:
    """The flags the benches share, each with this script's default: ``--batch``, ``--warmup``, ``--steps``,
    ``--rounds`` (those given a default), ``--json-out`` and the hidden ``--worker`` of :func:`run_worker`."""
    for name, default in defaults.items():
        ap.add_argument(f"--{name}", type=int, default=default, help=f"{COMMON_FLAGS[name]} (default: {default})")
    if json_out:
        ap.add_argument("--json-out", help="also write the results as JSON to this file")
    if worker:
        ap.add_argument("--worker", help=argparse.SUPPRESS)


def write_json(path: str | None, obj) -> None:
    """``--json-out``: the results as JSON (nothing without a path)."""
    if path:
        Path(path).write_text(json.dumps(obj, indent=1))


def hardware(device: str = "cpu") -> str:
    """The hardware part of a result file's name: ``cpuN`` (N cores), or the GPU's model (``h200`` for "NVIDIA
    H200", ``a100`` for "NVIDIA A100-SXM4-80GB")."""
    if device == "cpu":
        return f"cpu{os.cpu_count()}"
    import torch

    return torch.cuda.get_device_name().replace("NVIDIA", "").split()[0].split("-")[0].lower()


def result_name(script: str, device: str = "cpu", day: datetime.date | None = None) -> str:
    """``results/``'s name for a run of ``script`` today: ``SCRIPT_HARDWARE_DATE.md`` (bench/README.md)."""
    stem = Path(script).stem.replace("_", "-")
    return f"{stem}_{hardware(device)}_{(day or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()}.md"


def preamble(script: str, device: str = "cpu") -> str:
    """The lines a result file starts with: date, hardware, software, the command, and the file's name."""
    from importlib import metadata

    versions = []
    for name in ("torch", "deepspeed", "open_clip_torch"):  # without importing them (DeepSpeed's import talks)
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    gpu = f", {hardware(device)}" if device != "cpu" else ""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"- **date**: {when}",
            f"- **hardware**: {os.cpu_count()} cores ({cpu}){gpu}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
            f"- **software**: Python {platform.python_version()}, {', '.join(versions)}",
            f"- **command**: `{shlex.join([Path(sys.executable).name, *sys.argv])}`",
            f"- **result file**: bench/results/{result_name(script, device)}",
        ]
    )
