"""Peak memory and time of ONE forward+backward of the contrastive loss, W gloo ranks on CPU.

Compares, at global batch N (each rank holds N / W rows of D-dim fp32 embeddings):
  openclip_local  open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True)
  dsclip_local    dsclip build_loss("infonce_local")     (same math, uneven-batch aware)
  dsclip_tiled    dsclip build_loss("infonce_tiled")     (tiled ring InfoNCE, same value as the above)
  dsclip_siglip   dsclip build_loss("siglip")            (tiled ring sigmoid loss)

Every (N, loss) runs in fresh processes so one measurement cannot inherit another's heap. Per rank:
a small warm-up call (gloo connections, lazy init), then ``malloc_trim``, reset of the kernel's
peak-RSS counter (``/proc/self/clear_refs`` <- 5) and one timed forward+backward (wall time and
process CPU time, the latter less sensitive to other jobs sharing the cores; max over ranks); "peak" is
``VmHWM - VmRSS`` at the reset, i.e. the extra resident memory the loss needed on top of the
embeddings already allocated. The column "beyond grads" subtracts the two embedding gradients
(2 * b * D * 4 bytes) that any loss must produce. A config whose estimated peak would not fit in the
currently available memory is skipped and reported as such.

    OMP_NUM_THREADS=1 .venv/bin/python bench/loss_memory.py --sizes 4k,16k,32k,64k
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402  (and the repository root on the path)

LOSSES = ("openclip_local", "dsclip_local", "dsclip_tiled", "dsclip_siglip")
MB = 1024**2


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _make_loss(name: str, rank: int, world: int, tile: int):
    if name == "openclip_local":
        from open_clip.loss import ClipLoss

        return ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    from dsclip.losses import build_loss

    return {
        "dsclip_local": lambda: build_loss("infonce_local"),
        "dsclip_tiled": lambda: build_loss("infonce_tiled", tile_size=tile),
        "dsclip_siglip": lambda: build_loss("siglip", tile_size=tile),
    }[name]()


def _inputs(name, b, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
    y = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=-1).requires_grad_()
    scale = torch.tensor(14.3, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True) if name == "dsclip_siglip" else None
    return x, y, scale, bias


def _rank_main(rank, world, port, name, n, d, tile, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")  # OpenCLIP's gather triggers torch deprecation warnings on every rank
    try:
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        loss_fn = _make_loss(name, rank, world, tile)
        b = n // world
        # warm-up on a small batch (connections, lazy init), not measured
        x, y, s, bias = _inputs(name, 256, d, seed=rank)
        (loss_fn(x, y, s) if bias is None else loss_fn(x, y, s, bias)).backward()
        del x, y, s, bias
        x, y, s, bias = _inputs(name, b, d, seed=1000 + rank)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        dist.barrier()
        exact = H.reset_peak_rss()
        rss0 = H.proc_status_kb("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        loss = loss_fn(x, y, s) if bias is None else loss_fn(x, y, s, bias)
        loss.backward()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = H.proc_status_kb("VmHWM") - rss0  # without clear_refs: lifetime peak (an upper bound)
        assert x.grad is not None and y.grad is not None and torch.isfinite(loss)
        dist.barrier()
        queue.put(
            (
                rank,
                "ok",
                dict(time=elapsed, cpu=cpu, peak=peak * 1024, exact=exact, loss=float(loss.detach())),
            )
        )
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_config(name, n, d, world, tile, timeout):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from dsclip.testing.gloo_world import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, name, n, d, tile, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out, err = {}, None
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                err = f"rank {rank}: {payload.strip().splitlines()[-1]}"
                break
            out[rank] = payload
    except Exception as e:  # timeout
        err = f"{type(e).__name__} after {timeout} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if err is None and any(p.exitcode not in (0, None) for p in procs):
            err = "a rank exited with code " + ",".join(str(p.exitcode) for p in procs)
    return out, err


def estimate_bytes(name, n, d, world, tile) -> int:
    """Rough per-rank peak of the loss (for skipping configs that cannot fit)."""
    b = n // world
    if name in ("openclip_local", "dsclip_local"):
        # ~3.9 (b, N) fp32 matrices at the peak (8.4 GB measured for OpenCLIP at N=32k, 2 ranks)
        # + gathered features and their gradients
        return int(3.9 * 4 * b * n) + 4 * 4 * n * d + 64 * MB
    return 4 * (8 * b * d + 6 * tile * tile) + 64 * MB


def parse_size(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4k,16k,32k,64k", help="global batch sizes N (k = 1024)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tile-size", type=int, default=1024)
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"subset of {','.join(LOSSES)}")
    ap.add_argument("--mem-fraction", type=float, default=0.9, help="skip if world*estimate > this * MemAvailable")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    names = [s.strip() for s in args.losses.split(",")]
    unknown = set(names) - set(LOSSES)
    if unknown:
        ap.error(f"unknown losses {sorted(unknown)}")
    print(
        f"# loss memory bench: world={args.world} D={args.dim} fp32 tile={args.tile_size} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} torch {torch.__version__}",
        flush=True,
    )
    rows = []
    for n in sizes:
        for name in names:
            need = estimate_bytes(name, n, args.dim, args.world, args.tile_size)
            avail = _mem_available()
            if args.world * need > args.mem_fraction * avail:
                note = f"skipped: needs ~{need / 2**30:.1f} GiB/rank, {avail / 2**30:.1f} GiB available"
                rows.append((n, name, None, None, None, None, note))
                print(f"N={n} {name}: {note}", flush=True)
                continue
            out, err = run_config(name, n, args.dim, args.world, args.tile_size, args.timeout)
            if err:
                rows.append((n, name, None, None, None, None, f"failed: {err}"))
                print(f"N={n} {name}: failed: {err}", flush=True)
                continue
            t = max(o["time"] for o in out.values())
            cpu = max(o["cpu"] for o in out.values())
            peak = max(o["peak"] for o in out.values())
            grads = 2 * (n // args.world) * args.dim * 4
            note = "" if all(o["exact"] for o in out.values()) else "peak = lifetime max RSS (no clear_refs)"
            rows.append((n, name, t, cpu, peak, peak - grads, note))
            msg = f"{t:.2f} s (CPU {cpu:.2f} s), +{peak / MB:.0f} MB/rank"
            msg += f" ({(peak - grads) / MB:.0f} MB beyond grads)"
            print(f"N={n} {name}: {msg} loss={out[0]['loss']:.4f}", flush=True)
    print()
    print("| global N | loss | wall s | CPU s | peak extra RSS / rank (MB) | beyond emb. grads (MB) | note |")
    print("|---:|---|---:|---:|---:|---:|---|")

    def fmt(v, f):
        return "—" if v is None else f.format(v)

    for n, name, t, cpu, peak, beyond, note in rows:
        peak_mb = None if peak is None else peak / MB
        beyond_mb = None if beyond is None else beyond / MB
        print(
            f"| {n} | {name} | {fmt(t, '{:.2f}')} | {fmt(cpu, '{:.2f}')} | {fmt(peak_mb, '{:.0f}')} | "
            f"{fmt(beyond_mb, '{:.0f}')} | {note} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
