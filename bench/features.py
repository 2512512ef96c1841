"""Throughput features, each measured on/off with everything else equal (one row per feature).

  patch_dropout   FLIP patch dropout 0.5 vs 0 (``create_model(patch_dropout=...)``, --force-patch-dropout)
  attention       fused SDPA (what the towers use) vs the math path (``sdpa_kernel(SDPBackend.MATH)``)
  overlap_comm    ZeRO-2 ``overlap_comm`` on (shipped JSONs) vs off, ``contiguous_gradients`` on in both, 2 ranks
  contiguous_gradients  ZeRO-2 ``overlap_comm`` + ``contiguous_gradients`` on (shipped) vs both off, 2 ranks
  buckets         ZeRO-2 reduce/allgather bucket 2e8 (shipped) vs 5e6 elements, 2 ranks
  torchcompile    --torchcompile (inductor, every transformer block) vs eager; compilation happens in the
                  warm-up steps, which are not timed
  data_loader     ``dsclip train --config demo`` with --workers 0 vs 2: data-wait fraction (metrics.jsonl)

The step measurements use bench/vs_openclip.py's dsclip worker (build_engine + GradCacheStep, the
BENCH_CFG model, synthetic data, one thread per process, a fresh process per measurement, on/off
alternated in each round). Speedup = samples/s(on) / samples/s(off).

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/features.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_openclip as V  # noqa: E402

FEATURES = (
    "patch_dropout",
    "attention",
    "overlap_comm",
    "contiguous_gradients",
    "buckets",
    "torchcompile",
    "data_loader",
)


def step_specs(feature: str, common: dict) -> tuple[dict, dict]:
    """(on, off) dsclip worker specs for a step-throughput feature."""
    base = {"impl": "dsclip", "precision": "bf16", **common}  # common may override the precision
    if feature == "patch_dropout":
        return (
            {**base, "opts": {"model_kwargs": {"patch_dropout": 0.5}}},
            {**base, "opts": {"model_kwargs": {"patch_dropout": 0.0}}},
        )
    if feature == "attention":
        return {**base, "opts": {}}, {**base, "opts": {"sdpa_math": True}}
    if feature == "overlap_comm":
        on = {"zero_optimization": {"overlap_comm": True}}
        off = {"zero_optimization": {"overlap_comm": False}}
        return {**base, "world": 2, "opts": {"ds_overrides": on}}, {**base, "world": 2, "opts": {"ds_overrides": off}}
    if feature == "contiguous_gradients":
        on = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True}}
        off = {"zero_optimization": {"overlap_comm": False, "contiguous_gradients": False}}
        return {**base, "world": 2, "opts": {"ds_overrides": on}}, {**base, "world": 2, "opts": {"ds_overrides": off}}
    if feature == "buckets":
        small = {"zero_optimization": {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}}
        return {**base, "world": 2, "opts": {}}, {**base, "world": 2, "opts": {"ds_overrides": small}}
    if feature == "torchcompile":
        return {**base, "opts": {"extra": {"torchcompile": True}}}, {**base, "opts": {}}
    raise ValueError(feature)


def data_loader_run(workers: int, steps: int) -> dict:
    """dsclip train on the demo data (procedural images drawn by the loader); data-wait from metrics.jsonl."""
    root = V.ROOT
    with tempfile.TemporaryDirectory() as logs:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
        env.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".cache" / "torch_extensions"))
        cmd = [
            sys.executable,
            "-m",
            "dsclip",
            "train",
            "--config",
            "demo",
            "--logs",
            logs,
            "--name",
            "dl",
            "--max-steps",
            str(steps),
            "--log-every-n-steps",
            str(steps // 2),
            "--workers",
            str(workers),
            "--save-frequency",
            "0",
            "--report-to",
            "",
            "--demo-eval-samples",
            "16",
        ]
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-3000:])
        recs = [json.loads(x) for x in (Path(logs) / "dl" / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in recs if "data_wait_frac" in r][-1]  # the second window: after warm-up
        return {
            "samples_per_s": last["samples_per_s"],
            "data_wait_frac": last["data_wait_frac"],
            "peak_rss_mb": last["peak_mem_gb"] * 1024,
        }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data-steps", type=int, default=40)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="step features' precision")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    rows = []
    common = {"batch": a.batch, "warmup": a.warmup, "steps": a.steps, "precision": a.precision}
    for feat in a.features.split(","):
        print(f"== {feat}", flush=True)
        if feat == "data_loader":
            res = {"workers 2": [], "workers 0": []}
            for r in range(a.rounds):
                for name in ("workers 2", "workers 0") if r % 2 == 0 else ("workers 0", "workers 2"):
                    out = data_loader_run(int(name.split()[1]), a.data_steps)
                    res[name].append(out)
                    print(
                        f"  round {r + 1} {name}: {out['samples_per_s']:.1f} samples/s, data wait "
                        f"{100 * out['data_wait_frac']:.0f}%",
                        flush=True,
                    )
            on, off = V.summarize(res["workers 2"]), V.summarize(res["workers 0"])
            wait_on = sorted(x["data_wait_frac"] for x in res["workers 2"])[len(res["workers 2"]) // 2]
            wait_off = sorted(x["data_wait_frac"] for x in res["workers 0"])[len(res["workers 0"]) // 2]
            rows.append(
                {
                    "feature": feat,
                    "on": "--workers 2",
                    "off": "--workers 0",
                    "on_sps": on["samples_per_s"],
                    "off_sps": off["samples_per_s"],
                    "speedup": on["samples_per_s"] / off["samples_per_s"],
                    "note": f"data wait {100 * wait_on:.0f}% vs {100 * wait_off:.0f}%",
                }
            )
            continue
        on_spec, off_spec = step_specs(feat, common)
        res = V.alternate({"on": on_spec, "off": off_spec}, a.rounds)
        on, off = V.summarize(res["on"]), V.summarize(res["off"])
        labels = {
            "patch_dropout": ("0.5", "0"),
            "attention": ("SDPA (fused)", "math"),
            "overlap_comm": ("on (shipped)", "off"),
            "contiguous_gradients": ("overlap + contiguous on (shipped)", "both off"),
            "buckets": ("2e8 (shipped)", "5e6"),
            "torchcompile": ("--torchcompile (inductor)", "eager"),
        }[feat]
        rows.append(
            {
                "feature": feat,
                "on": labels[0],
                "off": labels[1],
                "on_sps": on["samples_per_s"],
                "off_sps": off["samples_per_s"],
                "speedup": on["samples_per_s"] / off["samples_per_s"],
                "note": f"CPU-time speedup {on['samples_per_cpu_s'] / off['samples_per_cpu_s']:.2f}x; "
                f"peak RSS "
                f"{on['peak_rss_mb']:.0f} vs {off['peak_rss_mb']:.0f} MB",
            }
        )
    print("\n| feature | on | off | samples/s on | samples/s off | speedup (on/off) | note |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['feature']} | {r['on']} | {r['off']} | {r['on_sps']:.2f} | {r['off_sps']:.2f} | "
            f"{r['speedup']:.2f}x | {r['note']} |"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
