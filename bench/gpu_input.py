"""The GPU input path on one GPU (issue #28.4): nvJPEG alone, and training fed from real-photo shards.

1. nvJPEG images/s alone: batched ``torchvision.io.decode_jpeg(list, device="cuda")`` over the shards'
   JPEGs; then the GPU path's whole training-process side (dsclip.data.gpu_decode.decode_batch:
   decode + per-sample crop + bicubic resize to 224), images/s.
2. ``dsclip train --model ViT-B-32`` (bf16, ZeRO-2) from those shards with ``--data-decode gpu`` and
   ``--workers`` (<= 8) against the same run on synthetic in-memory batches (``--dataset-type
   synthetic``), the same tokenizer, batch and steps: samples/s from metrics.jsonl (median of the
   logging windows after the first). Target: >= 90 % of the synthetic rate.

The shards are bench/real_photos.py's (scikit-image's bundled photos, img2dataset-style: shorter side
256-512 px, JPEG q90-95), made in parallel; its epoch is short and repeats (dsclip's epochs run
back to back without a stall). Run by bench/gpu_h200.sh (``STAGES=input``). ``--check`` runs the same
code on CPU at a toy size (decode on CPU, ``--data-decode cpu``, the demo model) to test the script
before device time is spent on it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from multiprocessing import Pool
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
if (ROOT / ".cache" / "skimage").is_dir():  # scikit-image's photos installed as real_photos.py says
    sys.path.insert(0, str(ROOT / ".cache" / "skimage"))
import real_photos as RP  # noqa: E402


def _sources():
    """scikit-image's photographs; without them (a bare device machine), generated stand-ins, said so."""
    from PIL import Image

    try:
        return [Image.open(f).convert("RGB") for f in RP.photo_files()], "scikit-image photos"
    except SystemExit:
        import numpy as np

        out = []
        for k in range(9):  # smooth gradients, waves and noise: compresses like a photo more than noise does
            rng = np.random.default_rng(k)
            y, x = np.mgrid[0:512, 0:768].astype(np.float32)
            img = np.stack([255 * x / 767, 255 * y / 511, 128 + 90 * np.sin(x / (9 + k) + y / 23)], -1)
            img += rng.normal(0, 6, img.shape)
            out.append(Image.fromarray(img.clip(0, 255).astype(np.uint8)))
        return out, "generated stand-ins (scikit-image's photos not found)"


def _one_shard(job):
    root, s, count, start = job
    srcs, _ = _sources()
    rng = random.Random(1000 + s)
    with tarfile.open(Path(root) / f"{s:05d}.tar", "w") as tar:
        for k in range(start, start + count):
            jpg = RP.make_sample(srcs[k % len(srcs)], rng)
            for ext, data in (("jpg", jpg), ("txt", " ".join(rng.choice(RP.WORDS) for _ in range(12)).encode())):
                info = tarfile.TarInfo(f"{k:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return count


def make_shards(root: Path, n: int, per_shard: int, procs: int) -> str:
    shards = math.ceil(n / per_shard)
    jobs = [(str(root), s, min(per_shard, n - s * per_shard), s * per_shard) for s in range(shards)]
    with Pool(procs) as pool:
        pool.map(_one_shard, jobs)
    (root / "sizes.json").write_text(json.dumps({f"{j[1]:05d}.tar": j[2] for j in jobs}))
    return str(root / f"{{00000..{shards - 1:05d}}}.tar")


def jpegs(root: Path) -> list[torch.Tensor]:
    out = []
    for p in sorted(root.glob("*.tar")):
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".jpg"):
                    out.append(torch.frombuffer(bytearray(tar.extractfile(m).read()), dtype=torch.uint8))
    return out


def decode_rates(datas: list[torch.Tensor], batch: int, device: torch.device, reps: int) -> dict:
    from torchvision.io import decode_jpeg

    from dsclip.data.gpu_decode import EncodedBatch, EncodedTrainTransform, decode_batch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    batches = [datas[i : i + batch] for i in range(0, len(datas) - batch + 1, batch)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        decode_jpeg(batches[0], device=device)  # warm-up: nvJPEG handles, buffers
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            for b in batches:
                decode_jpeg(b, device=device)
        sync()
        decode_only = reps * len(batches) * batch / (time.perf_counter() - t0)
    t = EncodedTrainTransform((224, 224))
    torch.manual_seed(0)
    enc = [EncodedBatch.collate([t(bytes(d.numpy())) for d in b]) for b in batches]
    tokens = torch.zeros(batch, 2, dtype=torch.long)
    decode_batch(enc[0], tokens, (224, 224), device)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        for e in enc:
            decode_batch(e, tokens, (224, 224), device)
    sync()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = reps * len(enc) * batch
    return {"decode_images_per_s": decode_only, "decode_crop_resize_images_per_s": n / wall,
            "training_process_host_ms_per_batch": 1e3 * cpu / (reps * len(enc))}  # fmt: skip


def train_rate(args: list[str], logs: Path, name: str, timeout: int) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "dsclip", "train", *args, "--logs", str(logs), "--name", name]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    tail = (p.stdout + p.stderr)[-3000:]
    if p.returncode != 0:
        return float("nan"), tail
    recs = [json.loads(ln) for ln in (logs / name / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rates = [r["samples_per_s"] for r in recs if "samples_per_s" in r]
    waits = [r.get("data_wait_frac", 0.0) for r in recs if "samples_per_s" in r]
    rate = statistics.median(rates[1:] if len(rates) > 1 else rates)
    return rate, f"windows {[round(x) for x in rates]}, data_wait_frac {[round(w, 2) for w in waits]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4096, help="Distinct samples in the shards (an epoch).")
    p.add_argument("--per-shard", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=96, help="Training steps per run.")
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--reps", type=int, default=3, help="Passes over the JPEGs for the decode rates.")
    p.add_argument("--check", action="store_true", help="Toy size on CPU: tests this script, measures nothing.")
    p.add_argument("--out", default=None, help="Write the JSON results here.")
    a = p.parse_args(argv)
    if a.check:
        a.samples, a.per_shard, a.batch_size, a.workers, a.steps, a.model, a.reps = 64, 32, 16, 1, 4, "demo", 1
    cuda = torch.cuda.is_available() and not a.check
    device = torch.device("cuda" if cuda else "cpu")
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": a.model,
                 "batch_size": a.batch_size, "workers": a.workers, "samples": a.samples}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "shards"
        root.mkdir()
        t0 = time.time()
        pattern = make_shards(root, a.samples, a.per_shard, max(1, min(8, os.cpu_count() or 1)))
        res["images_from"] = _sources()[1]
        datas = jpegs(root)
        res["jpeg_kb_mean"] = sum(len(d) for d in datas) / len(datas) / 1e3
        print(f"{len(datas)} JPEGs from {res['images_from']} ({res['jpeg_kb_mean']:.0f} KB mean) in "
              f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip
        res.update(decode_rates(datas, min(a.batch_size, len(datas)), device, a.reps))
        print(json.dumps(res), flush=True)
        epochs = math.ceil(a.steps * a.batch_size / a.samples)
        common = [
            "--model", a.model, "--batch-size", str(a.batch_size), "--train-num-samples", str(a.samples),
            "--epochs", str(epochs), "--max-steps", str(a.steps), "--tokenizer", "open_clip:ViT-B-32",
            "--precision", "bf16" if cuda else "fp32", "--deepspeed-config", "zero2_bf16" if cuda else "zero2_fp32",
            "--log-every-n-steps", str(max(1, a.steps // 6)), "--save-frequency", "0", "--warmup", "10",
            "--workers", str(a.workers),
        ]  # fmt: skip
        if not cuda:
            common += ["--device", "cpu"]
        logs = Path(tmp) / "runs"
        rate_real, note_real = train_rate(
            [*common, "--train-data", pattern, "--data-decode", "gpu" if cuda else "cpu"], logs, "real", 400
        )
        rate_syn, note_syn = train_rate([*common, "--dataset-type", "synthetic"], logs, "synthetic", 300)
    res.update(train_real_samples_per_s=rate_real, train_synthetic_samples_per_s=rate_syn,
               real_vs_synthetic=rate_real / rate_syn if rate_syn == rate_syn and rate_syn else float("nan"),
               real_note=note_real, synthetic_note=note_syn)  # fmt: skip
    print(f"| input | samples/s |\n|---|---|\n| real-photo shards, --data-decode {'gpu' if cuda else 'cpu'}, "
          f"{a.workers} workers | {rate_real:.0f} |\n| synthetic in-memory | {rate_syn:.0f} |\n"
          f"real / synthetic: {res['real_vs_synthetic']:.2f} (target >= 0.90)")  # fmt: skip
    print(f"{'nvJPEG' if cuda else 'decode_jpeg on CPU (a --check run)'} alone: {res['decode_images_per_s']:.0f} "
          f"images/s; decode + crop + resize: "
          f"{res['decode_crop_resize_images_per_s']:.0f} images/s ({res['training_process_host_ms_per_batch']:.1f} "
          f"ms of training-process CPU per batch of {a.batch_size})")  # fmt: skip
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    ok = rate_real == rate_real and rate_syn == rate_syn
    if not ok:
        print("a training run failed:\n", note_real if rate_real != rate_real else note_syn)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
