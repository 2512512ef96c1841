"""`dsclip plan` against one GPU: the largest micro-batch that fits, its peak memory, step time and MFU,
measured, beside what the planner predicted for that GPU (issue #29: ViT-bigG-14 under ZeRO-3 with
--grad-checkpointing; targets: memory within 15 %, step time within 25 %).

    python bench/gpu_plan_check.py --model ViT-bigG-14 --zero 3 --grad-checkpointing --json-out plan_check.json
    OMP_NUM_THREADS=1 python bench/gpu_plan_check.py --device cpu --model demo --gpu-memory-gb 2   # code paths

1. The prediction: ``make_plan`` for one GPU of this device's memory (K = 1, plain InfoNCE, the shipped
   ``zero{N}_{precision}.json``): the largest micro-batch M whose plan fits, and at a measured micro-batch
   its total memory and step time (from the MFU ``dsclip.plan.efficiency`` gives it, which says where it comes from).
2. The measurement, one child process per probe (a CUDA OOM inside a ZeRO-3 forward leaves gathered
   parameters behind, so a fresh engine per probe is the only clean retry; the device's memory and GEMM
   rate come from a child too, so this process holds no CUDA context on the GPU being measured): the
   engine as `dsclip train` builds it (bench/harness.py ``dsclip_engine``), the gradient-cache step
   at K = 1, two warm-up steps and ``--steps`` timed steps on synthetic batches. The probes are M, then
   M·(1 + tol) if M fits (does more fit than predicted?) or M·(1 - tol) if it does not: two probes say
   whether the largest batch is within ``--memory-tolerance`` of the prediction; ``--max-probes`` allows
   a bisection beyond.
3. Measured peak device memory = peak reserved by torch's allocator + what the device holds outside it
   (the CUDA context, cuBLAS/NCCL workspaces: device used minus reserved at the end), against the
   planner's total, which budgets those as its 2 GiB reserve. On CPU no OOM happens and memory is not
   measured: ``--device cpu`` runs the code paths only.
Prints a table and one JSON line; the MFU measured here is what ``dsclip.plan.efficiency.MEASURED`` takes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)

from dsclip.plan.planner import largest_fitting, make_plan  # noqa: E402

GiB = 2**30


def probe_sizes(predicted: int, fits, tol: float, max_probes: int) -> tuple[int, int | None, list[tuple[int, bool]]]:
    """Search the largest micro-batch that fits from the prediction; ``fits(m) -> bool`` is one probe.
    First the prediction, then one step of ``tol`` up (it fit) or down (it did not); later probes step up
    again while everything fits, halve while nothing does, or bisect between the largest fitting and the
    smallest failing size.
    Returns (lo, hi, probes): lo fits (0: nothing probed fits), hi does not (None: none failed), so the
    true largest micro-batch is in [lo, hi - 1]."""
    tried: list[tuple[int, bool]] = []
    lo, hi = 0, None
    m = max(1, predicted)
    while len(tried) < max_probes and m not in {t for t, _ in tried}:
        ok = fits(m)
        tried.append((m, ok))
        if ok:
            lo = max(lo, m)
        else:
            hi = m if hi is None else min(hi, m)
        if hi is not None and hi - lo <= 1:
            break
        if hi is None:
            m = max(lo + 1, round(lo * (1 + tol)))
        elif lo == 0:  # nothing fits yet: one tolerance step down, then halve
            m = max(1, min(hi - 1, round(hi * (1 - tol)) if len(tried) == 1 else hi // 2))
        else:
            m = (lo + hi) // 2
    return lo, hi, tried


def largest_planned(plan_fits) -> int:
    """The largest micro-batch (K = 1) whose plan fits: ``plan_fits(m) -> bool`` (0: not even one row)."""
    return largest_fitting(plan_fits)


def compare(predicted: float, measured: float) -> float:
    """Relative error of a prediction against the measurement (0.1: the prediction is 10 % high)."""
    return predicted / measured - 1.0


def run_child(a, *args: str) -> dict:
    """This script in a child process (a probe, or the device's facts); its last JSON line."""
    cmd = [sys.executable, __file__, *args, *a.forward]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.probe_timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(args)} exited {out.returncode} without a result: " + " | ".join(tail))
    return json.loads(lines[-1])


def device_info_main(a) -> int:
    """In a child: the device's name, memory and measured bf16 GEMM rate, so that the parent never holds
    a CUDA context (and its workspaces) on the GPU the probes measure."""
    dev = torch.device(a.device)
    info = {"device": "cpu", "total_gb": None, "bf16_peak_tflops": H.bf16_peak_tflops(dev)}
    if dev.type == "cuda":
        info.update(
            device=torch.cuda.get_device_name(), total_gb=torch.cuda.get_device_properties(0).total_memory / GiB
        )
    print(json.dumps(info), flush=True)
    return 0


def probe_main(a) -> int:
    """In the child: build, warm up, time; OOM is a result ({"fits": false}), not an error."""
    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.model import get_model_config
    from dsclip.train.gradcache import GradCacheStep

    H.single_rank_env(a.port)
    dev = torch.device(a.device)
    precision = a.precision if dev.type == "cuda" else "fp32"
    cfg = get_model_config(a.model)
    micro = a.probe
    result = {"micro_batch": micro, "fits": False}
    try:
        engine, bundle, _ = H.dsclip_engine(
            precision, micro, 1, cfg, 1, extra={"deepspeed_config": f"ds_configs/zero{a.zero}_{precision}.json"},
            grad_checkpointing=a.grad_checkpointing, device_type=dev.type,
        )  # fmt: skip
        step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=1)
        (batch,) = H.make_batches(cfg, micro, 1, dev)  # one batch on the device at a time, as in a run
        for _ in range(2):  # warm-up: optimizer states, allocator, ZeRO-3's trace
            step([batch])
        H.sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(a.steps):
            step([batch])
        H.sync(dev)
        dt = (time.perf_counter() - t) / a.steps
        result.update(fits=True, step_s=dt, samples_per_s=micro / dt)
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            outside = (total - free) - torch.cuda.memory_reserved()  # the context and non-torch workspaces
            result.update(
                peak_allocated_gb=torch.cuda.max_memory_allocated() / GiB,
                peak_reserved_gb=torch.cuda.max_memory_reserved() / GiB,
                outside_allocator_gb=outside / GiB,
                peak_gb=(torch.cuda.max_memory_reserved() + outside) / GiB,
            )
    except torch.OutOfMemoryError as e:  # what was asked for, what was free, and where: the report says why
        import traceback

        result["oom"] = " ".join(str(e).split())[:700]
        frames = traceback.extract_tb(e.__traceback__)[-4:]
        result["oom_at"] = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="ViT-bigG-14")
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--gpu-memory-gb", type=float, default=None, help="default: the device's own (CUDA)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per probe, after two warm-up steps")
    ap.add_argument("--memory-tolerance", type=float, default=0.15)
    ap.add_argument("--max-probes", type=int, default=2)
    ap.add_argument("--probe-timeout", type=int, default=600)
    ap.add_argument("--port", type=int, default=29541)
    H.common_args(ap)
    ap.add_argument("--probe", type=int, default=0, help=argparse.SUPPRESS)  # the child's micro-batch
    ap.add_argument("--device-info", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        return probe_main(a)
    if a.device_info:
        return device_info_main(a)
    from dsclip.model import get_model_config

    if a.gpu_memory_gb is None and torch.device(a.device).type != "cuda":
        ap.error("--gpu-memory-gb is needed off CUDA (the memory the plan is made for)")
    a.forward = [
        "--device", a.device, "--model", a.model, "--zero", str(a.zero), "--precision", a.precision,
        "--steps", str(a.steps), "--port", str(a.port), *(["--grad-checkpointing"] if a.grad_checkpointing else []),
    ]  # fmt: skip
    info = run_child(a, "--device-info")  # this process stays off the GPU
    peak = info["bf16_peak_tflops"]
    if a.gpu_memory_gb is None:
        a.gpu_memory_gb = info["total_gb"]

    def plan_at(micro: int):
        return make_plan(
            a.model, gpus=1, gpu_memory_gb=a.gpu_memory_gb, batch_size=micro, zero=a.zero, precision=a.precision,
            grad_checkpointing=a.grad_checkpointing, loss="infonce", peak_tflops=peak, micro_batch=micro,
        )  # fmt: skip

    predicted_max = largest_planned(lambda m: plan_at(m).fits)
    print(f"measured dense bf16 GEMM rate: {peak:.0f} TFLOP/s; plan: largest micro-batch {predicted_max} "
          f"on {a.gpu_memory_gb:.1f} GiB", flush=True)  # fmt: skip
    results: dict[int, dict] = {}

    def fits(m: int) -> bool:
        results[m] = run_child(a, "--probe", str(m))
        r = results[m]
        oom = f"does not fit: {r.get('oom')} at {r.get('oom_at')}"
        verdict = f"fits, {r['step_s']:.3f} s/step" if r["fits"] else oom
        print(f"probe {m}: {verdict}", flush=True)
        return r["fits"]

    largest, smallest_failing, tried = probe_sizes(predicted_max, fits, a.memory_tolerance, a.max_probes)
    report = {
        "device": info["device"],
        "model": a.model, "zero": a.zero, "precision": a.precision, "grad_checkpointing": a.grad_checkpointing,
        "gpu_memory_gb": a.gpu_memory_gb, "bf16_peak_tflops": peak, "predicted_max_micro_batch": predicted_max,
        "probes": tried, "largest_fitting_probed": largest, "smallest_failing_probed": smallest_failing,
    }  # fmt: skip
    if largest:
        r, p = results[largest], plan_at(largest)
        mfu = H.train_flops_per_sample(get_model_config(a.model)) * r["samples_per_s"] / (peak * 1e12)
        report.update(
            measured=r, mfu=mfu, plan_mfu=p.mfu, plan_mfu_source=p.mfu_source, plan_step_s=p.step_time_s,
            plan_memory_gb=p.memory_gb["total"], step_time_error=compare(p.step_time_s, r["step_s"]),
        )  # fmt: skip
        if "peak_gb" in r:
            report["memory_error"] = compare(p.memory_gb["total"], r["peak_gb"])
            mem = f"{r['peak_gb']:.1f} GiB (plan {p.memory_gb['total']:.1f}, {100 * report['memory_error']:+.0f}%)"
        else:
            mem = "not measured off CUDA"
        step = f"{r['step_s']:.3f} s (plan {p.step_time_s:.3f}, {100 * report['step_time_error']:+.0f}%)"
        print(
            f"\n| model | ZeRO | largest micro-batch probed (plan {predicted_max}, first failing {smallest_failing}) "
            "| peak memory | step | MFU (plan's) |\n|---|---:|---:|---|---|---|"
        )
        mfus = f"{100 * mfu:.1f}% ({100 * p.mfu:.1f}%: {p.mfu_source})"
        print(f"| {a.model} | {a.zero} | {largest} | {mem} | {step} | {mfus} |")
    else:
        print(f"nothing fits: probes {tried}")
    print(json.dumps(report), flush=True)
    H.write_json(a.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
