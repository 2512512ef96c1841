"""Ranks sharing a host's cores, side by side: torch's default intra-op threads in every rank (what a
`deepspeed --num_gpus N` CPU run got before dsclip divided the cores) against dsclip's division
(dsclip/engine/world/cores.py share_cores: the host's cores / the local ranks on them, OMP_NUM_THREADS unset).

Each round runs the same `deepspeed --num_gpus W --module dsclip train` twice, order alternating:
  default  OMP_NUM_THREADS = torch's own default (this machine's physical cores) in every rank
  divided  OMP_NUM_THREADS unset: dsclip sets cores / local ranks
and reads every logged step's samples/s from metrics.jsonl (the first 2 steps left out: warm-up).
Reported per setting: the median step rate over all rounds, the slowest step, and the ratio of medians.

    .venv/bin/python bench/rank_threads.py --world 2 --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dsclip.testing.gloo_world import free_port  # noqa: E402  (ports the test suite's own launches use)

PY = sys.executable
DEEPSPEED = str(Path(PY).parent / "deepspeed")


def torch_default_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([PY, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True)
    return int(out.stdout)


def run(setting: str, default_threads: int, a, logs: Path, name: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if setting == "default":
        env["OMP_NUM_THREADS"] = str(default_threads)
    cmd = [DEEPSPEED, "--num_gpus", str(a.world), "--master_port", str(free_port()), "--module", "dsclip", "train",
           "--config", a.config, "--logs", str(logs), "--name", name, "--max-steps", str(a.steps),
           "--batch-size", str(a.batch), "--accum-freq", str(a.accum_freq), "--save-every-n-steps", "0",
           "--deepspeed-config", a.deepspeed_config]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    lines = (logs / name / "metrics.jsonl").read_text().splitlines()
    return [r["samples_per_s"] for r in map(json.loads, lines) if "samples_per_s" in r and r["step"] > 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum-freq", type=int, default=2)
    ap.add_argument("--deepspeed-config", default="ds_configs/zero2_fp32.json")
    a = ap.parse_args()
    default_threads = torch_default_threads()
    print(f"torch's default intra-op threads here: {default_threads}; cpus: {len(os.sched_getaffinity(0))}")
    rates: dict[str, list[float]] = {"default": [], "divided": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["default", "divided"] if r % 2 == 0 else ["divided", "default"]
            for setting in order:
                got = run(setting, default_threads, a, Path(tmp), f"{setting}{r}")
                rates[setting] += got
                print(f"round {r} {setting:8s} median {statistics.median(got):8.1f} samples/s  min {min(got):7.1f}")
    print(f"\n{a.config}, world {a.world}, batch {a.batch} x accum {a.accum_freq} per rank, {a.rounds} rounds")
    for setting, got in rates.items():
        print(f"  {setting:8s} median {statistics.median(got):8.1f} samples/s  slowest step {min(got):7.1f}")
    ratio = statistics.median(rates["divided"]) / statistics.median(rates["default"])
    print(f"  divided / default: {ratio:.2f}x (median step rate)")


if __name__ == "__main__":
    main()
