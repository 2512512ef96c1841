"""The fake rank's host time per step against a real gloo rank's, once the real rank's collective time is out.

``dsclip plan --measure`` times rank 0 of a world-N job under torch's fake process group, whose collectives
return at once. If everything else a rank does is that of world N, its host work per step equals a real
rank's minus what the real rank spends on communication. This bench checks that on this CPU: for each
world size and configuration, one fake child (dsclip.rehearsal, every configuration in one fake world) and
one real gloo world of N processes (dsclip.testing.gloo_world.run_world) run the same rehearsal on the demo
model, bf16, synthetic batches. Rank 0's medians are reported.

The N real ranks share this machine's cores, so wall time is no fair measure (a real rank's wall time holds
the time its peers had the core). Two CPU measures, both from dsclip.rehearsal.counter's counter, which clocks every
collective call, async handle's wait and coalescing-manager exit on three clocks:
- process CPU (``time.process_time``: all threads, gloo's workers included) per step, minus the process CPU
  inside those intervals. gloo's threads also burn CPU outside them for async ops (ZeRO-3's prefetched
  gathers), which stays in the real side: this ratio errs low.
- the main thread's CPU (``time.thread_time``) per step, minus the main thread's CPU inside those
  intervals: the rank's own host work, which is what the fake rank reproduces (gloo's threads are comm).
On CPU DeepSpeed's ``overlap_comm`` has no side stream (the CPU accelerator's streams are no-ops), so its
reductions run inside the main thread's collective calls either way; ``--overlap-comm false`` checks it.
``--fake-crowd`` runs N fake children at once so the fake rank, like a real one, shares the cores with
N - 1 busy peers (an upper bracket: a real rank's peers idle inside collectives).

    PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=.cache/torch_extensions OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/rehearsal_host_time.py --worlds 2 4 --steps 20 --overlap-comm shipped false
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsclip.plan.planner import shipped_ds_config  # noqa: E402
from dsclip.rehearsal.room import RehearsalSpec, read_child, rehearse_many, run_real_rank, start_child  # noqa: E402
from dsclip.testing.gloo_world import run_world  # noqa: E402


def _med_ms(xs: list) -> float:
    return statistics.median(xs) * 1e3


def _config(zero: int, overlap: str) -> dict:
    cfg = json.loads(json.dumps(shipped_ds_config(zero, "bf16")[1]))
    if overlap != "shipped":
        cfg["zero_optimization"]["overlap_comm"] = overlap == "true"
    return cfg


def _row(world: int, s: RehearsalSpec, f, r: dict) -> str:
    zo = s.ds_config["zero_optimization"]
    fcpu, rcpu, rcomm = _med_ms(f.cpu_s), _med_ms(r["cpu_s"]), _med_ms(r["comm_cpu_s"])
    fthr, fthr_c = _med_ms(f.thread_s), _med_ms(f.comm_thread_s)
    rthr, rthr_c = _med_ms(r["thread_s"]), _med_ms(r["comm_thread_s"])
    rhost = statistics.median(t - c for t, c in zip(r["thread_s"], r["comm_thread_s"], strict=True)) * 1e3
    fhost = statistics.median(t - c for t, c in zip(f.thread_s, f.comm_thread_s, strict=True)) * 1e3
    rproc = statistics.median(t - c for t, c in zip(r["cpu_s"], r["comm_cpu_s"], strict=True)) * 1e3
    bytes_equal = "" if f.traffic == r["traffic"] else " (bytes differ!)"
    return (
        f"| {world} | {zo['stage']} | {s.accum_freq} | {str(zo.get('overlap_comm', False)).lower()} | "
        f"{_med_ms(r['step_s']):.1f} | {_med_ms(r['comm_s']):.1f} | "
        f"{fcpu:.1f} | {rcpu:.1f} | {rcomm:.1f} | {fcpu / rproc:.2f} | "
        f"{fthr:.1f} | {fthr_c:.1f} | {rthr:.1f} | {rthr_c:.1f} | {fthr / rhost:.2f} | "
        f"{fhost / rhost:.2f}{bytes_equal} |"
    )


def _fake_crowd(specs: list[RehearsalSpec], n: int) -> list:
    """``n`` identical fake children at once; the first one's results (the others only load the cores)."""
    procs = [start_child(specs) for _ in range(n)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=1800)
        finally:
            proc.tmp.cleanup()
        results.append(read_child(proc.returncode, out, err))
    return results[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--overlap-comm", choices=["shipped", "true", "false"], nargs="+", default=["shipped"],
                    help="the shipped JSON's overlap_comm, or forced on / off (one row per choice)")  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--fake-crowd", action="store_true",
                    help="run N fake children at once (the first one reported), so the fake rank shares the cores "
                    "with N - 1 busy peers as a real rank does")  # fmt: skip
    a = ap.parse_args()
    print(
        "| world | ZeRO | K | overlap_comm | real wall ms | real comm wall ms "
        "| fake CPU ms | real CPU ms | real comm CPU ms | fake / (real - comm) CPU "
        "| fake main ms | fake main in comm ms | real main ms | real main in comm ms "
        "| fake main / real host | (fake main - comm) / real host |"
    )
    print("|" + "---|" * 16)
    for world in a.worlds:
        specs = [
            RehearsalSpec(
                model=a.model,
                world=world,
                batch_size=a.batch_size,
                accum_freq=k,
                ds_config=_config(z, ov),
                precision="bf16",
                steps=a.steps,
            )  # fmt: skip
            for ov in a.overlap_comm
            for z in a.zero
            for k in a.accum
        ]
        fake = _fake_crowd(specs, world) if a.fake_crowd else rehearse_many(specs)
        real = run_world(run_real_rank, world, [asdict(s) for s in specs])[0]
        for s, f, r in zip(specs, fake, real, strict=True):
            print(_row(world, s, f, r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
