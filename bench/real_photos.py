"""Training input on real photographs: samples per CPU-second, and CPU cores per GPU needed.

Builds img2dataset-style webdataset shards (``KEY.jpg`` + ``KEY.txt``) from the colour photographs
that ship inside scikit-image (``skimage/data/*.png|jpg``: astronaut, chelsea, coffee, rocket, ...;
found with ``importlib.util.find_spec``, so only the files are needed, not skimage's imports). Each
sample is a random crop (30-100 % of the area), a random flip and a random scale so the shorter side
is 256-512 px, stored as JPEG quality 90-95: images differ, and sizes match LAION/DataComp shards.

Then times, alternated over rounds (min / median / max), the training input in one process
(``--workers 0``: the DataLoader runs in this process, so ``process_time`` is the input's CPU):
* ``pil``: dsclip's input before issue #28 (``--data-decode pil``: PIL decode, RGB copy, PIL
  RandomResizedCrop, float32 normalise in the worker);
* ``cpu``: the cheaper CPU path (``--data-decode cpu``: DCT-scaled or libjpeg-turbo decode, crop
  before resize, uint8) with the training process's uint8 -> float normalisation on CPU, as on a machine
  without a GPU; ``cpu-worker``: the same without that normalisation, which beside a GPU runs on the
  GPU -- what the worker cores spend, the column of the cores-per-GPU table;
* the JPEG decode alone (libjpeg-turbo, full size): the ceiling of any path that decodes every pixel;
* ``gpu-share``: what the GPU path (``--data-decode gpu``) leaves on the CPU: its real worker side
  (tar read, shuffle, tokenisation, the image header and the crop draw, the CPU fallback for images
  nvJPEG does not take, the encoded batch). No GPU here: the training-process side
  (dsclip.data.gpu_decode.decode_batch) is timed apart on the same batches, run on CPU -- decode on
  CPU standing in for nvJPEG -- and is NOT counted in this row;
* ``cpu-worker@pre`` / ``gpu-share@pre``: the same two on the same samples written pre-resized by
  ``dsclip data write --resize N --quality Q`` (``--pre-resize`` / ``--pre-quality``), with the bytes
  per sample that saves;
* ``openclip``: OpenCLIP's ``get_wds_dataset`` with ``image_transform(is_train=True)``, in a child
  process with the webdataset OpenCLIP's training extra pins (``open_clip_torch[training]``:
  ``webdataset<=0.2.86``; its ``group_by_keys_nothrow`` raises ``KeyError: 'fname'`` on the end-of-shard
  marker webdataset 1.x yields). ``--openclip-webdataset DIR`` names a ``pip install --target`` of it.

    pip install --no-deps --target .cache/skimage scikit-image
    pip install --no-deps --target .cache/webdataset-0.2.86 webdataset==0.2.86
    PYTHONPATH=$PWD:$PWD/.cache/skimage OMP_NUM_THREADS=1 python bench/real_photos.py --samples 384 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# One-H200 bf16 rates, samples/s per GPU: ViT-B-32 ~5,000 (~6,000 with --torchcompile) as issue #28
# quotes them; ViT-L-14 675 (results/gpu-h200_h200_2026-12-01.md, gpu_bench.py); ViT-H-14 not measured:
# ViT-L-14's rate scaled by the image tower's FLOPs (~81 vs ~167 GFLOPs per image), an estimate.
H200_RATES = {"ViT-B-32": (5000, 6000), "ViT-L-14": (675, None), "ViT-H-14 (est.)": (330, None)}
PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "motorcycle_left",
    "motorcycle_right",
    "hubble_deep_field",
    "retina",
    "ihc",
)
WORDS = "a photo of the small large red blue green dog cat house tree car on in with at beach city".split()


def photo_files() -> list[Path]:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "bench/real_photos.py needs scikit-image's bundled photos: "
            "pip install --no-deps --target .cache/skimage scikit-image and add .cache/skimage to PYTHONPATH"
        )
    d = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = [f for n in PHOTOS for f in d.glob(n + ".*") if f.suffix in (".png", ".jpg")]
    if not files:
        raise SystemExit(f"no photographs found in {d}")
    return files


def make_sample(src, rng: random.Random) -> bytes:
    from PIL import Image

    W, H = src.size
    a = rng.uniform(0.3, 1.0)
    w, h = max(64, int(W * math.sqrt(a))), max(64, int(H * math.sqrt(a)))
    x, y = rng.randint(0, W - w), rng.randint(0, H - h)
    img = src.crop((x, y, x + w, y + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    short = rng.randint(256, 512)
    s = short / min(w, h)
    img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=rng.randint(90, 95))
    return buf.getvalue()


def make_shards(root: Path, n: int, per_shard: int) -> tuple[str, list[int]]:
    from PIL import Image

    srcs = [Image.open(f).convert("RGB") for f in photo_files()]
    rng = random.Random(0)
    sizes, k, shards = [], 0, math.ceil(n / per_shard)
    for s in range(shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for _ in range(min(per_shard, n - k)):
                jpg = make_sample(srcs[k % len(srcs)], rng)
                sizes.append(len(jpg))
                for ext, data in (("jpg", jpg), ("txt", " ".join(rng.choice(WORDS) for _ in range(12)).encode())):
                    info = tarfile.TarInfo(f"{k:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                k += 1
    return str(root / f"{{00000..{shards - 1:05d}}}.tar"), sizes


def pre_resized_shards(src_dir: Path, root: Path, short: int, quality: int) -> tuple[str, list[int]]:
    """The same samples written by ``dsclip data write --resize SHORT --quality Q`` (write_shards):
    shorter side ``short``, re-encoded as JPEG of ``quality``, as img2dataset's keep_ratio resize."""
    from dsclip.data.tools import write_shards

    files = root / "files"
    files.mkdir(parents=True)
    samples = []
    for tar_path in sorted(src_dir.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in sorted(members.items()):
            if name.endswith(".jpg"):
                (files / name).write_bytes(data)
                samples.append((str(files / name), members[name[:-4] + ".txt"].decode()))
    r = write_shards(samples, root / "shards", shard_size=160, resize=short, quality=quality, progress=False)
    sizes = []
    for tar_path in sorted((root / "shards").glob("shard-*.tar")):
        with tarfile.open(tar_path) as tar:
            sizes += [m.size for m in tar.getmembers() if m.name.endswith(".jpg")]
    return str(root / "shards" / f"shard-{{00000..{r['shards'] - 1:05d}}}.tar"), sizes


def run_dsclip(pattern: str, n: int, batch: int, tok, mode: str, keep: list | None = None) -> float:
    """Samples per CPU-second of dsclip's input in ``mode`` (``--data-decode``; ``gpu-share``: the GPU
    path's worker side only, its batches appended to ``keep`` for :func:`device_side_on_cpu`;
    ``cpu-worker``: the CPU path without the training process's uint8 -> float normalisation, which
    runs on the GPU where there is one)."""
    from dsclip.data import DataConfig, build_train_data

    cfg = DataConfig(train_data=pattern, train_num_samples=n, workers=0, shuffle_buffer=500)
    cfg.data_decode = {"gpu-share": "gpu", "cpu-worker": "cpu"}.get(mode, mode)  # gpu: no CUDA asked for here
    td = build_train_data(cfg, tokenizer=tok, image_size=224, batch_size=batch, rank=0, world_size=1, seed=0)
    if mode in ("gpu-share", "cpu-worker"):
        td.device_prep = None  # the training process's share: nvJPEG's / the GPU's where there is one
    # With a device_prep the loader prepares one batch ahead: when next() returns batch 0, batch 1 is
    # already read and prepared, before the clock starts. Its rows are not counted (they were counted
    # until 2026-12-04, which overstated the prepared modes by one batch in the measured ones: ~25 %).
    read_ahead = batch if td.device_prep is not None else 0
    try:
        it = td.batches(0)
        next(it)  # shuffle-buffer fill is not steady state
        c0, m = time.process_time(), 0
        for images, tokens in it:
            m += len(images)
            if keep is not None:
                keep.append((images, tokens))
        return (m - read_ahead) / max(time.process_time() - c0, 1e-9)
    finally:
        td.close()


def openclip_rate(pattern: str, n: int, batch: int) -> float:
    """Samples per CPU-second of OpenCLIP's ``get_wds_dataset`` (run in this process)."""
    from types import SimpleNamespace

    import open_clip

    if importlib.util.find_spec("pandas") is None:  # open_clip_train.data imports it for its CSV dataset only
        import types

        sys.modules["pandas"] = types.ModuleType("pandas")
    from open_clip_train.data import get_wds_dataset

    args = SimpleNamespace(
        train_data=pattern, train_num_samples=n, dataset_resampled=False, seed=0, batch_size=batch,
        workers=0, world_size=1, train_data_upsampling_factors=None, distributed=False, val_data=None,
    )  # fmt: skip
    pre = open_clip.image_transform(224, is_train=True)
    tok = open_clip.get_tokenizer("ViT-B-32")
    di = get_wds_dataset(args, pre, True, epoch=0, tokenizer=tok)
    it = iter(di.dataloader)
    next(it)
    c0, m = time.process_time(), 0
    for images, _ in it:
        m += images.shape[0]
    return m / max(time.process_time() - c0, 1e-9)


def run_openclip(pattern: str, n: int, batch: int, webdataset_dir: str) -> float:
    """:func:`openclip_rate` in a child process whose ``webdataset`` is the one in ``webdataset_dir``
    (OpenCLIP's pinned release); its CPU time is the child's, start-up left out."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([webdataset_dir, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--openclip-child", pattern, str(n), str(batch)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return float(out.stdout.strip().splitlines()[-1])


def decode_alone(shard_dir: Path) -> float:
    """Samples per CPU-second of the JPEG decode alone (torchvision's ``decode_jpeg``, libjpeg-turbo, full
    size, no crop, resize, tar read or tokenisation): the ceiling of any CPU path that decodes every
    pixel. At JPEG quality 90-95 the entropy decoding dominates, which a reduced DCT scale does not
    shrink (measured: 1/2 scale decodes in ~0.9x the time of full scale on these photos)."""
    from dsclip.data.fast_transforms import decode_jpeg_rgb

    jpegs = []
    for shard in sorted(shard_dir.glob("*.tar")):
        with tarfile.open(shard) as tar:
            jpegs += [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")]
    c0 = time.process_time()
    for d in jpegs:
        decode_jpeg_rgb(torch.frombuffer(bytearray(d), dtype=torch.uint8))
    return len(jpegs) / max(time.process_time() - c0, 1e-9)


def device_side_on_cpu(batches: list) -> float:
    """Samples per CPU-second of the GPU path's training-process side (dsclip.data.gpu_decode.decode_batch:
    batched ``decode_jpeg``, per-sample crop + bicubic resize) run on CPU: decode on CPU standing in for
    nvJPEG. On a GPU this work leaves the CPU; here it says what nvJPEG and the GPU transform take off it."""
    from dsclip.data.gpu_decode import decode_batch

    c0, m = time.process_time(), 0
    for encoded, tokens in batches:
        decode_batch(encoded, tokens, (224, 224), "cpu")
        m += len(encoded)
    return m / max(time.process_time() - c0, 1e-9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=640, help="Samples per measurement.")
    p.add_argument("--per-shard", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="Write the markdown report here.")
    p.add_argument("--pre-resize", type=int, default=256, help="Also time shards written pre-resized to this "
                   "shorter side (dsclip data write --resize); 0: skip.")  # fmt: skip
    p.add_argument("--pre-quality", type=int, default=90, help="Their JPEG quality (dsclip data write --quality).")
    p.add_argument("--openclip-webdataset", default=".cache/webdataset-0.2.86", help="A pip --target install of "
                   "the webdataset OpenCLIP's training extra pins (<=0.2.86) for the OpenCLIP row.")  # fmt: skip
    p.add_argument("--openclip-child", nargs=3, metavar=("PATTERN", "N", "BATCH"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.openclip_child:
        pattern, n, batch = a.openclip_child
        import webdataset

        print(f"webdataset {webdataset.__version__}", file=sys.stderr)
        print(openclip_rate(pattern, int(n), int(batch)))
        return 0
    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer

    wds_dir = Path(a.openclip_webdataset).resolve()
    have_oc = importlib.util.find_spec("open_clip_train") is not None and (wds_dir / "webdataset").is_dir()
    modes = ["pil", "cpu", "cpu-worker", "gpu-share", "decode-alone"] + (["openclip"] if have_oc else [])
    res: dict[str, list[float]] = {m: [] for m in modes + ["nvjpeg-standin"]}
    oc_error = (
        "open_clip_train is not installed" if importlib.util.find_spec("open_clip_train") is None
        else f"no webdataset<=0.2.86 in {a.openclip_webdataset} (pip install --no-deps --target "
        f"{a.openclip_webdataset} webdataset==0.2.86)"
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tok = SentencePieceTokenizer(ensure_demo_tokenizer(Path(tmp) / "tok"), 77)
        shard_dir = Path(tmp) / "shards"
        shard_dir.mkdir()
        pattern, sizes = make_shards(shard_dir, a.samples, a.per_shard)
        print(f"{len(sizes)} samples, JPEG {np.mean(sizes) / 1e3:.0f} KB mean "
              f"({min(sizes) / 1e3:.0f}-{max(sizes) / 1e3:.0f} KB)", flush=True)  # fmt: skip
        patterns = {m: pattern for m in modes}
        if a.pre_resize:
            pre_pattern, pre_sizes = pre_resized_shards(shard_dir, Path(tmp) / "pre", a.pre_resize, a.pre_quality)
            for m in ("cpu-worker", "gpu-share"):
                modes.append(f"{m}@pre")
                patterns[f"{m}@pre"] = pre_pattern
                res[f"{m}@pre"] = []
        for r in range(a.rounds):  # alternated: load changes on a shared machine hit every mode alike
            for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                keep = [] if m == "gpu-share" else None
                try:
                    if m == "openclip":
                        v = run_openclip(pattern, a.samples, a.batch_size, str(wds_dir))
                    elif m == "decode-alone":
                        v = decode_alone(shard_dir)
                    else:
                        v = run_dsclip(patterns[m], a.samples, a.batch_size, tok, m.split("@")[0], keep)
                except Exception as e:  # the OpenCLIP child failed (its own error's last line)
                    if m != "openclip":
                        raise
                    print(f"OpenCLIP get_wds_dataset not measured: {e.__class__.__name__}: {e}", flush=True)
                    oc_error = f"{e.__class__.__name__}: {e}"
                    modes.remove(m)
                    del res[m]
                    have_oc = False
                    continue
                res[m].append(v)
                print(f"round {r} {m}: {v:.0f} samples per CPU-second", flush=True)
                if keep:
                    res["nvjpeg-standin"].append(device_side_on_cpu(keep))
                    print(f"round {r} device side on CPU: {res['nvjpeg-standin'][-1]:.0f}", flush=True)
    med = {m: median(v) for m, v in res.items()}
    oc_note = [] if have_oc else ["", f"OpenCLIP's `get_wds_dataset` not measured: {oc_error}."]
    names = {
        "pil": "dsclip before #28 (`--data-decode pil`)",
        "cpu": "dsclip CPU path (`--data-decode cpu`), its uint8 -> float normalisation on CPU too (no GPU)",
        "cpu-worker": "dsclip CPU path, worker side: what stays on the CPU beside a GPU (uint8 out)",
        "gpu-share": "dsclip GPU path (`--data-decode gpu`), worker side: what stays on the CPU",
        "openclip": "OpenCLIP `get_wds_dataset` (webdataset 0.2.86, as `open_clip_torch[training]` pins it)",
        "cpu-worker@pre": f"dsclip CPU path, worker side, on shards pre-resized to {a.pre_resize} px q{a.pre_quality}",
        "gpu-share@pre": f"dsclip GPU path, worker side, on shards pre-resized to {a.pre_resize} px q{a.pre_quality}",
        "decode-alone": "JPEG decode alone (libjpeg-turbo, full size; no crop, resize, tar or tokens): the ceiling",
        "nvjpeg-standin": "GPU path, training-process side run on CPU (decode on CPU standing in for nvJPEG; "
        "on a GPU this leaves the CPU)",
    }
    lines = [
        "## Input on real photographs (bench/real_photos.py)",
        "",
        f"{len(sizes)} samples from scikit-image's bundled photos (random crop/flip, shorter side 256-512 px, "
        f"JPEG q90-95, {np.mean(sizes) / 1e3:.0f} KB mean), batch {a.batch_size}, 224 px, one process "
        f"(`--workers 0`), `OMP_NUM_THREADS=1`, {a.rounds} alternated rounds, on a shared "
        f"{os.cpu_count()}-core machine (load {os.getloadavg()[0]:.1f} at the end). Samples per CPU-second "
        "(what one dedicated worker core sustains):",
        "",
        "| input | min | median | max | vs before |",
        "|---|---|---|---|---|",
    ]
    for m in res:
        v = res[m]
        lines.append(f"| {names[m]} | {min(v):.0f} | {med[m]:.0f} | {max(v):.0f} | {med[m] / med['pil']:.2f}x |")
    if have_oc:
        lines += [
            "",
            f"Against OpenCLIP's `get_wds_dataset` in the same run: dsclip before #28 "
            f"{med['pil'] / med['openclip']:.2f}x, the CPU path {med['cpu'] / med['openclip']:.2f}x (its worker "
            f"side {med['cpu-worker'] / med['openclip']:.2f}x), the GPU path's worker side "
            f"{med['gpu-share'] / med['openclip']:.2f}x.",
        ]
    if a.pre_resize:
        kb, pre_kb = np.mean(sizes) / 1e3, np.mean(pre_sizes) / 1e3
        lines += [
            "",
            f"Pre-resized shards (`dsclip data write --resize {a.pre_resize} --quality {a.pre_quality}`) save "
            f"{kb - pre_kb:.0f} KB per sample ({kb:.0f} -> {pre_kb:.0f} KB, {100 * (1 - pre_kb / kb):.0f}% of the "
            f"bytes read and shipped) and make the CPU path's worker side "
            f"{med['cpu-worker@pre'] / med['cpu-worker']:.2f}x and the GPU path's worker side "
            f"{med['gpu-share@pre'] / med['gpu-share']:.2f}x as fast per CPU-second.",
        ]
    lines += oc_note
    lines += [
        "",
        "CPU cores per GPU needed (one-H200 bf16 rates: ViT-B-32 as issue #28 quotes, ViT-L-14 from "
        "results/gpu-h200_h200_2026-12-01.md, ViT-H-14 estimated from FLOPs; rate / samples per CPU-second):",
        "",
    ]
    cols = [m for m in ("pil", "cpu-worker", "gpu-share", "openclip") if m in med]
    lines.append("| model | samples/s per GPU | " + " | ".join(cols) + " |")
    lines.append("|---|---|" + "---|" * len(cols))
    for model, (rate, compiled) in H200_RATES.items():
        for rr, tag in ((rate, ""), (compiled, " (--torchcompile)")):
            if rr:
                lines.append(f"| {model}{tag} | {rr} | " + " | ".join(f"{rr / med[m]:.1f}" for m in cols) + " |")
    lines += ["", "    PYTHONPATH=$PWD:$PWD/.cache/skimage OMP_NUM_THREADS=1 python bench/real_photos.py "
              f"--samples {a.samples} --rounds {a.rounds} --pre-resize {a.pre_resize} "
              f"--pre-quality {a.pre_quality}"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
