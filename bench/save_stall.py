"""What a checkpoint save costs the step loop, blocking vs asynchronous, and what resume verification reads on
rank 0 before and after per-rank verification (issue 65).

Two gloo ranks build dsclip's engine as ``dsclip train`` does (bench/harness.py: the shipped ZeRO JSON of the
stage, bf16) for a real architecture, then each save goes through dsclip's Checkpointer with dsclip's
checkpoint engine installed:

- **blocking** (``--no-async-save``): the seconds ``Checkpointer.save`` keeps the step loop, the max over ranks;
- **async**: ``stall`` = the seconds ``save`` keeps the step loop (this rank's state copied to host memory),
  ``write`` = the background write that overlaps training, then the completion (one collective) — max over ranks;
- **bytes written per rank** (DeepSpeed's files: data-parallel rank 0 also writes the 16-bit module file);
- **verification on rank 0**: the seconds and bytes rank 0 checksums before a resume, reading every file of the
  tag (before: rank 0 verified the whole checkpoint) vs only the files it loads (after:
  ``manifest.loading_rank``; the other rank verifies its own share at the same time). The files are in the
  page cache (just written), so the seconds are crc32 speed, not a cold file system's read speed: the bytes are
  the figure that carries over.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/save_stall.py --models ViT-B-32,ViT-L-14 --stages 2,3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)


def _rank(rank: int, world: int, model: str, stage: int, precision: str, out: str, repeats: int) -> dict:
    from dsclip.checkpoint import manifest
    from dsclip.checkpoint.async_save import DsclipCheckpointEngine
    from dsclip.checkpoint.ds_checkpoint import Checkpointer
    from dsclip.dist import barrier
    from dsclip.model import get_model_config

    cfg = get_model_config(model)
    engine, bundle, _ = H.dsclip_engine(
        precision, 2, 1, cfg, world, extra={"deepspeed_config": f"ds_configs/zero{stage}_{precision}.json"}
    )
    _one_step(engine, bundle, cfg)  # the Adam moments exist from the first step on: a checkpoint's real size
    DsclipCheckpointEngine.install(engine)
    res = {"params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())}
    for mode in ("blocking", "async"):
        ck = Checkpointer(Path(out) / mode, every_n_steps=1, every_n_epochs=0, keep_last=1, rank=rank)
        ck.async_save = mode == "async"
        for step in range(1, repeats + 1):
            barrier()
            t0 = time.perf_counter()
            ck.save(engine, step, {"step": step})
            stall = time.perf_counter() - t0
            if ck.in_flight is not None:
                ck.drain("bench")
            total = time.perf_counter() - t0
            times = ck.save_times[-1]
            res.setdefault(mode, []).append(
                {"stall_s": stall, "total_s": total, "write_s": times.write_s, "bytes": times.bytes}
            )
    tag = Path(out) / "async" / "checkpoints" / f"step_{repeats:09d}"
    files = {rel: e["size"] for rel, e in json.loads((tag / "MANIFEST.json").read_text())["files"].items()}
    barrier()
    if rank == 0:
        t0 = time.perf_counter()
        assert manifest.verify(tag).ok
        res["verify_all_s"], res["verify_all_bytes"] = time.perf_counter() - t0, sum(files.values())
    barrier()
    t0 = time.perf_counter()
    assert manifest.verify(tag, owned=lambda rel: manifest.loading_rank(rel, world) == rank).ok
    res["verify_own_s"] = time.perf_counter() - t0
    res["verify_own_bytes"] = sum(n for rel, n in files.items() if manifest.loading_rank(rel, world) == rank)
    return res


def _one_step(engine, bundle, cfg: dict) -> None:
    from dsclip.engine.build import autocast_dtype
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep

    step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle), accum_freq=1)
    engine.train()
    step(H.make_batches(cfg, 2, 1, "cpu"), grad_norm=False)


def _median(rows: list[dict], key: str) -> float:
    import statistics

    return statistics.median(r[key] for r in rows)


def measure(model: str, stage: int, precision: str, world: int, repeats: int) -> dict:
    from dsclip.testing.gloo_world import run_world

    with tempfile.TemporaryDirectory() as out:  # /tmp: on the disk here (not tmpfs)
        ranks = run_world(_rank, world, model, stage, precision, out, repeats, timeout=3600)
    row = {"model": model, "stage": stage, "params": ranks[0]["params"]}
    for mode in ("blocking", "async"):  # the first save is reported apart: it allocates the host buffers
        row[f"{mode}_stall_s"] = max(_median(r[mode][1:] or r[mode], "stall_s") for r in ranks)
        row[f"{mode}_total_s"] = max(_median(r[mode][1:] or r[mode], "total_s") for r in ranks)
    row["async_first_stall_s"] = max(r["async"][0]["stall_s"] for r in ranks)
    row["write_s"] = max(_median(r["async"], "write_s") for r in ranks)
    row["bytes"] = [r["async"][-1]["bytes"] for r in ranks]
    row["verify_all_s"], row["verify_all_bytes"] = ranks[0]["verify_all_s"], ranks[0]["verify_all_bytes"]
    row["verify_own_s"] = [r["verify_own_s"] for r in ranks]
    row["verify_own_bytes"] = [r["verify_own_bytes"] for r in ranks]
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| model (params) | ZeRO | blocking save s | async stall s | stall / blocking | first async stall s | "
        "background write s | bytes written per rank (GB) | rank 0 verify before: s, GB | after: s, GB | "
        "after / before (bytes) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        gb = ", ".join(f"{b / 1e9:.2f}" for b in r["bytes"])
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.0f} M) | {r['stage']} | {r['blocking_stall_s']:.2f} | "
            f"{r['async_stall_s']:.3f} | {r['async_stall_s'] / r['blocking_stall_s']:.3f} | "
            f"{r['async_first_stall_s']:.2f} | {r['write_s']:.2f} | "
            f"{gb} | {r['verify_all_s']:.2f}, {r['verify_all_bytes'] / 1e9:.2f} | "
            f"{r['verify_own_s'][0]:.2f}, {r['verify_own_bytes'][0] / 1e9:.2f} | "
            f"{r['verify_own_bytes'][0] / r['verify_all_bytes']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ViT-B-32,ViT-L-14")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=3, help="saves per mode (the median of all but the first is reported)"
    )
    H.common_args(ap)
    a = ap.parse_args()
    H.one_thread()
    rows = []
    for model in a.models.split(","):
        for stage in (int(s) for s in a.stages.split(",")):
            rows.append(measure(model, stage, a.precision, a.world, a.repeats))
            print(table(rows[-1:]), flush=True)
    print(H.preamble(__file__))
    print(
        f"- **world size**: {a.world} gloo ranks, {a.precision}, one training step (batch 2 per rank) then "
        f"{a.repeats} saves per mode (median of saves 2..{a.repeats}; the first async save, which allocates the "
        "host buffers, apart); files in /tmp on the VM's disk\n"
    )
    print(table(rows))
    H.write_json(a.json_out, rows)


if __name__ == "__main__":
    main()
