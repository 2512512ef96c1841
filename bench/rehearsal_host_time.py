"""The fake rank's host time per step against a real gloo rank's, once the real rank's collective time is out.

``dsclip plan --measure`` times rank 0 of a world-N job under torch's fake process group, whose collectives
return at once. If everything else a rank does is that of world N, its host time per step equals a real
rank's minus the time the real rank spends inside collectives. This bench checks that on this CPU: for each
world size and configuration, one fake child (dsclip.rehearsal, every configuration in one fake world) and
one real gloo world of N processes (dsclip.testing.gloo_world.run_world) run the same rehearsal on the demo model,
bf16, synthetic batches; the real rank's ``comm`` is its wall time inside collective calls (the counter's
``seconds``: for async calls only the launch, so the difference errs high). Rank 0's medians are reported.

The N real ranks share this machine's cores (one visible to each process here, shared by five sessions), so
a real rank's wall time also holds the time its peers had the core: wall-time ratios land near 1/N. The
process CPU time per step (``time.process_time``, all the rank's threads: gloo's included) is the fair
measure on a shared core, and the last two columns compare it.

    PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=.cache/torch_extensions OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/rehearsal_host_time.py --worlds 2 4 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsclip.plan import shipped_ds_config  # noqa: E402
from dsclip.rehearsal import RehearsalSpec, rehearse_many, run_real_rank  # noqa: E402
from dsclip.testing.gloo_world import run_world  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default="demo")
    a = ap.parse_args()
    print(
        "| world | ZeRO | K | fake ms/step | real ms/step | real comm ms | real - comm ms | fake / (real - comm) "
        "| fake CPU ms/step | real CPU ms/step | fake / real CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world in a.worlds:
        specs = [
            RehearsalSpec(
                model=a.model,
                world=world,
                batch_size=a.batch_size,
                accum_freq=k,
                ds_config=shipped_ds_config(z, "bf16")[1],
                precision="bf16",
                steps=a.steps,
            )  # fmt: skip
            for z in a.zero
            for k in a.accum
        ]
        fake = rehearse_many(specs)
        real = run_world(run_real_rank, world, [asdict(s) for s in specs])[0]
        for s, f, r in zip(specs, fake, real, strict=True):
            fs = statistics.median(f.step_s) * 1e3
            rs = statistics.median(r["step_s"]) * 1e3
            rc = statistics.median(r["comm_s"]) * 1e3
            fc = statistics.median(f.cpu_s) * 1e3
            rcpu = statistics.median(r["cpu_s"]) * 1e3
            bytes_equal = "" if f.traffic == r["traffic"] else " (bytes differ!)"
            print(
                f"| {world} | {s.ds_config['zero_optimization']['stage']} | {s.accum_freq} | {fs:.1f} | {rs:.1f} | "
                f"{rc:.1f} | {rs - rc:.1f} | {fs / (rs - rc):.2f}{bytes_equal} | {fc:.1f} | {rcpu:.1f} | "
                f"{fc / rcpu:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
