"""Epoch-boundary stall: throughput of the first logging window of each epoch vs the other windows.

``dsclip train`` on the demo data with 21 optimizer steps per epoch (2,688 samples, batch 128, world 1),
logging every 7 steps (3 windows per epoch), no checkpoints or evaluation at the boundaries, so the
windows measure training and data loading only. Two variants, alternated round by round:

  one-stream   dsclip as shipped: the loader's stream runs on into the next epoch, so the next epoch's
               first batches are prefetched while the current one ends (dsclip/data/loader.py).
  reopen       the previous behaviour: the stream is reopened at every epoch start (persistent workers,
               but their first batch of the epoch is requested only when the epoch begins).

Windows of epoch 0 are left out (start-up); "first" = the first window of epochs 1..E-1.

    flock /tmp/dsclip-bench.lock env OMP_NUM_THREADS=1 .venv/bin/python bench/epoch_boundary.py
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

# Runs dsclip's CLI; with "reopen" TrainData reopens its stream at every epoch start (the old loader).
RUNNER = """
import sys
if sys.argv[1] == "reopen":
    from dsclip.data.loader import TrainData
    def _seek(self, epoch, start_step):
        self._stream, self._pos = self._open(epoch, start_step), (epoch, start_step)
    TrainData._seek = _seek
from dsclip.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_once(variant: str, out: Path, epochs: int, steps: int, batch: int, every: int) -> list[dict]:
    name = f"{variant}-{len(list(out.glob('*')))}"
    args = [
        "train",
        "--config",
        "dsclip/recipes/demo.yaml",
        "--demo-num-samples",
        str(steps * batch),
        "--batch-size",
        str(batch),
        "--epochs",
        str(epochs),
        "--log-every-n-steps",
        str(every),
        "--save-frequency",
        "0",
        "--report-to",
        "",
        "--logs",
        str(out),
        "--name",
        name,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DSCLIP_LOG_WORLD="0")
    p = subprocess.run(
        [sys.executable, "-c", RUNNER, variant, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if p.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "samples_per_s" in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=21, help="optimizer steps per epoch")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--every", type=int, default=7, help="logging window, steps")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    res: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for variant in ("one-stream", "reopen") if r % 2 == 0 else ("reopen", "one-stream"):
                recs = run_once(variant, Path(d), a.epochs, a.steps, a.batch, a.every)
                acc = res.setdefault(variant, {"first": [], "rest": [], "first_wait": [], "rest_wait": []})
                for rec in recs:
                    step = rec["step"]
                    if step <= a.steps:
                        continue  # epoch 0: start-up
                    first = (step - 1) % a.steps < a.every
                    acc["first" if first else "rest"].append(rec["samples_per_s"])
                    acc["first_wait" if first else "rest_wait"].append(rec["data_wait_frac"])
                print(
                    f"round {r + 1} {variant}: first windows {[round(x, 1) for x in acc['first'][-(a.epochs - 1) :]]}",
                    flush=True,
                )
    print(
        "\n| loader | first window samples/s (median, min-max) | other windows samples/s (median, min-max) | "
        "first / other | data wait first / other |"
    )
    print("|---|---:|---:|---:|---:|")
    for variant, acc in res.items():
        f, o = acc["first"], acc["rest"]
        print(
            f"| {variant} | {statistics.median(f):.1f} ({min(f):.1f}-{max(f):.1f}) | {statistics.median(o):.1f} "
            f"({min(o):.1f}-{max(o):.1f}) | {statistics.median(f) / statistics.median(o):.2f} | "
            f"{100 * statistics.median(acc['first_wait']):.1f}% / {100 * statistics.median(acc['rest_wait']):.1f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
