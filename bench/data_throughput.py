"""Data-loading throughput: decoded samples/s per DataLoader worker on 224 px JPEG webdataset shards.

Builds synthetic shards (photo-like JPEGs: low-frequency colour fields + fine noise, ~15-25 KB at
224 px, like LAION images resized by img2dataset), then times dsclip's real training input
(``build_train_data`` with dataset_type webdataset: tar read, shuffle buffer, JPEG decode,
RandomResizedCrop + normalize, sentencepiece tokenization, batching) for several worker counts.
Reports samples/s, samples/s per worker, and the workers one GPU needs to feed ViT-B/32 at
OpenCLIP's A100 rate (~600 samples/s/GPU).

    OMP_NUM_THREADS=1 python bench/data_throughput.py --workers 1 2 --samples 2000
    python bench/data_throughput.py --write-readme   # also updates "## Data throughput" in bench/README.md
"""

from __future__ import annotations

import argparse
import io
import math
import os
import platform
import re
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_RATE = 600.0  # samples/s per GPU: OpenCLIP ViT-B/32 on A100


def make_image(rng: np.random.Generator, size: int) -> bytes:
    from PIL import Image

    low = rng.uniform(0, 255, size=(8, 8, 3)).astype(np.uint8)
    img = np.asarray(Image.fromarray(low).resize((size, size), Image.BICUBIC), dtype=np.float32)
    img += rng.normal(0, 12, size=img.shape)  # texture: keeps the JPEG size realistic
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_shards(root: Path, n: int, per_shard: int, size: int) -> tuple[str, float]:
    rng = np.random.default_rng(0)
    pool = [make_image(rng, size) for _ in range(min(n, 256))]  # reuse: decoding cost is per sample anyway
    words = "a photo of the small large red blue green dog cat house tree car on in with at beach city".split()
    k = 0
    shards = math.ceil(n / per_shard)
    for s in range(shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for _ in range(min(per_shard, n - k)):
                for ext, data in (
                    ("jpg", pool[k % len(pool)]),
                    ("txt", " ".join(rng.choice(words, size=12)).encode()),
                ):
                    info = tarfile.TarInfo(f"{k:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                k += 1
    return str(root / f"{{00000..{shards - 1:05d}}}.tar"), float(np.mean([len(p) for p in pool]))


def _cpu_seconds(procs) -> float:
    total = 0.0
    for pr in procs:
        try:
            t = pr.cpu_times()
            total += t.user + t.system
        except Exception:  # a process that already exited
            pass
    return total


def measure(pattern: str, n: int, workers: int, batch: int, image_size: int, tokenizer, warmup: int):
    """(wall samples/s, samples per CPU-second of the loading processes).

    The second number is what one dedicated core sustains; it is robust to other jobs sharing the
    machine (which only stretch the wall clock)."""
    import psutil

    from dsclip.data import DataConfig, build_train_data

    cfg = DataConfig(train_data=pattern, train_num_samples=n, workers=workers, shuffle_buffer=1000)
    td = build_train_data(
        cfg, tokenizer=tokenizer, image_size=image_size, batch_size=batch, rank=0, world_size=1, seed=0
    )
    me = psutil.Process()
    try:
        it = td.batches(0)
        for _ in range(warmup):  # worker start-up and shuffle-buffer fill are not steady state
            next(it)
        procs = [me] if workers == 0 else me.children()
        c0, t0 = _cpu_seconds(procs), time.perf_counter()
        m = 0
        for images, _ in it:
            m += images.shape[0]
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(procs) - c0
        return m / wall, m / max(cpu, 1e-9)
    finally:
        td.close()


def update_readme(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Data throughput (bench/data_throughput.py)\n"
    pat = re.compile(r"^## Data throughput\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(text):
        text = pat.sub(section.rstrip() + "\n\n", text)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--samples", type=int, default=2000, help="Samples per measurement.")
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--stored-size", type=int, default=224, help="Side of the JPEGs in the shards.")
    p.add_argument("--image-size", type=int, default=224, help="Model input size (RandomResizedCrop output).")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--write-readme", action="store_true", help="Write the table as a new result file under bench/results/."
    )
    a = p.parse_args(argv)
    import torch

    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tok = SentencePieceTokenizer(ensure_demo_tokenizer(Path(tmp) / "tok"), 77)
        pattern, jpeg_bytes = make_shards(Path(tmp), a.samples, a.per_shard, a.stored_size)
        rows = []
        for w in a.workers:
            rate, per_cpu = measure(pattern, a.samples, w, a.batch_size, a.image_size, tok, warmup=max(2, w))
            rows.append((w, rate, rate / max(w, 1), per_cpu))
            print(f"workers={w}: {rate:.0f} samples/s wall, {per_cpu:.0f} samples per CPU-second", flush=True)
    with_workers = [r for r in rows if r[0] >= 1] or rows
    per_worker = sum(r[3] for r in with_workers) / len(with_workers)  # per dedicated core
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    ncpu = os.cpu_count()
    lines = [
        "## Data throughput",
        "",
        "`bench/data_throughput.py`: dsclip's webdataset training input end to end (tar read, shuffle "
        f"buffer, JPEG decode, RandomResizedCrop {a.image_size} + normalize, sentencepiece tokenization, "
        f"batches of {a.batch_size}) on synthetic {a.stored_size} px JPEG shards "
        f"(mean {jpeg_bytes / 1024:.0f} KB/image), "
        f"{a.samples} samples per measurement after warm-up. Machine: {ncpu} CPU cores ({cpu}), "
        f"torch {torch.__version__}, one thread per worker. The last column (samples per CPU-second of the "
        "worker processes; workers=0: of the main process) is what one dedicated core sustains; wall rates "
        f"also reflect other load on the machine (1-min load average at the end: {load:.1f}).",
        "",
        "| workers | samples/s (wall) | wall samples/s per worker | samples per worker CPU-second |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {w} | {r:.0f} | {pw:.0f} | {pc:.0f} |" for w, r, pw, pc in rows]
    need = math.ceil(TARGET_RATE / per_worker)
    lines += [
        "",
        f"Workers per GPU to feed ViT-B/32 at OpenCLIP's A100 rate (~{TARGET_RATE:.0f} samples/s/GPU): "
        f"**{need}** (= ceil({TARGET_RATE:.0f} / {per_worker:.0f}) with one dedicated core per worker), i.e. "
        f"`--workers {need}` per rank plus a core for the training process; plan ~{need + 2} cores per GPU. "
        "Decoding cost grows with the stored pixels: for shards kept at 384-512 px rerun with "
        "`--stored-size 512` (decode + resize then dominate and more workers are needed).",
    ]
    section = "\n".join(lines)
    print("\n" + section)
    if a.write_readme:
        # one file per measured run (bench/README.md indexes them); the date keeps earlier runs
        day = time.strftime("%Y-%m-%d", time.gmtime())
        out = Path(__file__).resolve().parent / "results" / f"data-throughput_cpu{os.cpu_count()}_{day}.md"
        update_readme(out, section)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
