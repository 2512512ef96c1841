"""What a webdataset resume costs: time to the first batch and bytes read, by the position in the epoch.

The training input as ``dsclip train`` builds it (``build_wds_train_data``: one rank, ``--workers 2``,
``--batch-size 256``, the default 5,000-sample shuffle buffer and ``--data-decode auto``, the demo
tokenizer) over 100,000 img2dataset-style samples (~31 KB noise JPEG + txt + json) in 100 shards, asked
for its first batch at step 0, at 50 % and at 90 % of the epoch. Each measurement runs in a fresh
interpreter whose shard (and index) files were dropped from the page cache first
(``posix_fadvise(POSIX_FADV_DONTNEED)`` per file: /proc/sys/vm/drop_caches needs root on the host), so
every byte comes from the disk.

``before`` is dsclip at main b09564b (a resume skips ``start_step * 256`` raw samples by reading them),
exported with ``git archive`` into a folder (``--old-code``); ``after`` is this tree (the resume replays
the shard, shuffle and batch decisions on the shard index and reads only the samples its batches take).
The two alternate within each round. Bytes: ``/proc/PID/io`` of the training process and its
DataLoader workers when the first batch arrives: ``read_bytes`` (what the disk delivered, read-ahead
included) and ``rchar`` (what read(2) returned, page cache or not).

    OMP_NUM_THREADS=1 python bench/resume_cost.py --generate --data /work/data_resume   # once: 3.3 GB
    OMP_NUM_THREADS=1 python bench/resume_cost.py --data /work/data_resume --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness as H

OLD_COMMIT = "b09564b"
POSITIONS = (0.0, 0.5, 0.9)


# ------------------------------------------------------------------------------------------------ data
def generate(out: Path, shards: int, per_shard: int, side: int, quality: int) -> None:
    """``shard-NNNNN.tar`` of ``KEY.jpg`` (a side x side noise JPEG, ~31 KB at 224 px, quality 75), ``KEY.txt``
    and ``KEY.json``, as img2dataset writes them, plus ``sizes.json``; shards already there are kept."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for s in range(shards):
        name = f"shard-{s:05d}.tar"
        sizes[name] = per_shard
        if (out / name).exists():
            continue
        rng = np.random.default_rng(s)
        tmp = out / f".{name}.tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(per_shard):
                row = s * per_shard + i
                buf = io.BytesIO()
                pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
                caption = f"a photo of noise number {row}"
                meta = json.dumps({"caption": caption, "source": f"{row}.jpg"})
                for ext, data in (("jpg", buf.getvalue()), ("txt", caption.encode()), ("json", meta.encode())):
                    info = tarfile.TarInfo(f"{row:09d}.{ext}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, out / name)
    (out / "sizes.json").write_text(json.dumps(sizes, indent=1))


def export_old_code(dest: Path) -> Path:
    """dsclip at OLD_COMMIT, exported (``git archive``: no worktree, no change to the repository)."""
    if not (dest / "dsclip" / "__init__.py").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(H.ROOT), "archive", OLD_COMMIT, "dsclip"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


# ---------------------------------------------------------------------------------------------- worker
def drop_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _io(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def worker(spec: dict) -> dict:
    sys.path.insert(0, spec["code"])  # before dsclip is imported: the tree measured
    import torch

    from dsclip.data import DataConfig
    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.data.webdataset import build_wds_train_data

    torch.set_num_threads(1)
    tokenizer = SentencePieceTokenizer(ensure_demo_tokenizer(H.ROOT / ".cache" / "dsclip"), 77)
    data = Path(spec["data"])
    drop_page_cache(sorted(data.glob("shard-*.tar*")) + [data / "sizes.json"])
    cfg = DataConfig(train_data=str(data / f"shard-{{00000..{spec['shards'] - 1:05d}}}.tar"), workers=spec["workers"])
    me = os.getpid()
    io0, cpu0, t0 = _io(me), time.process_time(), time.perf_counter()
    td = build_wds_train_data(
        cfg, tokenizer=tokenizer, image_size=224, batch_size=spec["batch"], rank=0, world_size=1, seed=0
    )
    start = int(spec["position"] * td.steps_per_epoch)
    then = min(spec["then"], td.steps_per_epoch - start - 1)  # batches of this epoch only
    try:  # closed on any error too: the loader's workers ignore stop signals
        batches = td.batches(0, start)
        images, tokens = next(batches)
        t1 = time.perf_counter()
        main_io = _io(me)
        kids = [_io(c) for c in _children(me)]  # the persistent DataLoader workers, alive until close()
        for _ in range(then):  # the steady rate after it: every sample read by offset, shuffled
            next(batches)
        t2 = time.perf_counter()
    finally:
        td.close()
    read = {k: main_io[k] - io0[k] + sum(c[k] for c in kids) for k in ("read_bytes", "rchar")}
    return {
        "start_step": start,
        "steps_per_epoch": td.steps_per_epoch,
        "seconds": t1 - t0,
        "then_samples_per_s": then * spec["batch"] / (t2 - t1) if then else float("nan"),
        "main_cpu_s": time.process_time() - cpu0,
        "tokens_checksum": int((tokens * torch.arange(1, tokens.shape[1] + 1)).sum()),
        "dsclip": sys.modules["dsclip"].__file__,
        "shape": list(images.shape),
        **read,
    }


# ----------------------------------------------------------------------------------------------- main
def run(spec: dict, code: Path) -> dict:
    """One measurement in a fresh interpreter, with ``code`` (a dsclip tree) first on the path."""
    res = H.run_worker({**spec, "code": str(code)}, __file__, timeout=1800)
    assert res["dsclip"].startswith(str(code)), res["dsclip"]
    return res


def _table(results: dict[tuple[str, float], list[dict]], rounds: int) -> list[str]:
    fields = ("seconds", "read_bytes", "rchar")
    med = {k: {f: statistics.median(r[f] for r in v) for f in fields} for k, v in results.items()}
    rng = {k: (min(r["seconds"] for r in v), max(r["seconds"] for r in v)) for k, v in results.items()}
    lines = [
        "| position (step) | before: s to 1st batch | after: s | before / after: of the medians; per round "
        "(median, range) | before: MB read (disk / read(2)) | after: MB read | after at p / after at 0 % "
        "(time, disk MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in POSITIONS:
        b, a, a0 = med[("before", p)], med[("after", p)], med[("after", 0.0)]
        step = results[("after", p)][0]["start_step"]
        # the two ran back to back in each round: their ratio there sees the same load
        paired = [x["seconds"] / y["seconds"] for x, y in zip(results[("before", p)], results[("after", p)])]
        lines.append(
            f"| {p:.0%} ({step}) | {b['seconds']:.2f} ({rng[('before', p)][0]:.2f}-{rng[('before', p)][1]:.2f}) "
            f"| {a['seconds']:.2f} ({rng[('after', p)][0]:.2f}-{rng[('after', p)][1]:.2f}) "
            f"| {b['seconds'] / a['seconds']:.1f}x; {statistics.median(paired):.1f}x ({min(paired):.1f}-"
            f"{max(paired):.1f}) | {b['read_bytes'] / 1e6:.0f} / {b['rchar'] / 1e6:.0f} "
            f"| {a['read_bytes'] / 1e6:.1f} / {a['rchar'] / 1e6:.1f} "
            f"| {a['seconds'] / a0['seconds']:.2f}x, {a['read_bytes'] / max(a0['read_bytes'], 1):.2f}x |"
        )
    lines.append(f"\nMedians of {rounds} rounds (range in brackets); MB = 10^6 bytes.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/work/data_resume", help="shard folder (outside the repository)")
    ap.add_argument("--generate", action="store_true", help="write the shards first (kept ones are reused)")
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--then", type=int, default=6, help="batches timed after the first one (the rate after it)")
    ap.add_argument("--old-code", help=f"dsclip at {OLD_COMMIT} (default: exported into a temporary folder)")
    ap.add_argument("--out", help="write the result file here (default: print it)")
    H.common_args(ap, worker=True, batch=256, rounds=3)
    a = ap.parse_args()
    if a.worker:
        H.emit_result(worker(json.loads(a.worker)))
        return
    data = Path(a.data)
    if a.generate:
        generate(data, a.shards, a.per_shard, side=224, quality=75)
    pattern = str(data / f"shard-{{00000..{a.shards - 1:05d}}}.tar")
    env = dict(os.environ, PYTHONPATH=str(H.ROOT))
    subprocess.run([sys.executable, "-m", "dsclip", "data", "index", pattern], cwd=H.ROOT, env=env, check=True)
    old = export_old_code(Path(a.old_code or Path(tempfile.gettempdir()) / f"dsclip-{OLD_COMMIT}"))
    codes = {"before": old, "after": H.ROOT}
    base = {"data": str(data), "shards": a.shards, "workers": a.workers, "batch": a.batch, "then": a.then}
    results: dict[tuple[str, float], list[dict]] = {}
    for r in range(a.rounds):
        for p in POSITIONS:  # before and after back to back at each position, their order swapped every round
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                res = run({**base, "position": p}, codes[name])
                results.setdefault((name, p), []).append(res)
                mb = f"{res['read_bytes'] / 1e6:.1f} MB from disk, {res['rchar'] / 1e6:.1f} MB read(2)"
                rate = f"then {res['then_samples_per_s']:.0f} samples/s"
                print(
                    f"round {r + 1} {name} at {p:.0%} (step {res['start_step']}): {res['seconds']:.2f} s, {mb}, {rate}"
                )
    for p in POSITIONS:  # the same first batch either way (same samples, same crops)
        assert results[("before", p)][0]["tokens_checksum"] == results[("after", p)][0]["tokens_checksum"], p
    size = sum(f.stat().st_size for f in data.glob("shard-*.tar"))
    text = "\n".join(
        [
            "# Resume cost: time to the first batch and bytes read, by the position in the epoch",
            "",
            H.preamble(__file__),
            f"- **data**: {a.shards * a.per_shard} samples in {a.shards} shards ({size / 1e9:.2f} GB; 224 px noise "
            f"JPEG q75 ~31 KB + txt + json), one rank, --workers {a.workers}, --batch-size {a.batch}, "
            "shuffle buffer 5000, page cache dropped per file before each measurement",
            f"- **before**: dsclip {OLD_COMMIT} (main); **after**: this tree",
            "",
            *_table(results, a.rounds),
        ]
    )
    H.write_json(a.json_out, [{"code": k[0], "position": k[1], "rounds": v} for k, v in results.items()])
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
