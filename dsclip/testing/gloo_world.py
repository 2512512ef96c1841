"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Used by the multi-process tests (losses, gradient cache, sharding) and by bench/. Each rank is a fresh
process, so state never leaks between ranks, between tests or into the pytest process.

The ranks come from a fork server (one per pytest worker) that has imported torch, timm, DeepSpeed and
dsclip once and done nothing else: a rank is a fork of that pristine process. Spawning an interpreter per
rank spent ~4-5 s of CPU on start-up and imports before each test's first line, on every rank of ~120
worlds per `make test`. What a fork server does not give by itself, and ``_rank_main`` restores: the
environment of the test at the time it starts the world (the server's is the one of its own start), and
the settings torch reads from that environment at import (inductor's compile threads).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import random
import socket
import traceback

import torch.multiprocessing as mp


def _port_slice() -> range:
    """This pytest-xdist worker's share of the ports below the kernel's ephemeral range.

    Ports from bind(("", 0)) come from the ephemeral range, which the kernel also hands to every outgoing
    connection (gloo opens many): a port probed free can be taken before MASTER_PORT binds it. Ports
    below that range are only ever taken by an explicit bind, and giving each xdist worker its own
    slice means two workers of one session never pick the same one. Other sessions on the machine
    (other checkouts) pick at random inside the same slices; the bind check below catches the rest.
    """
    lo = 10000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        hi = 32768  # Linux's default lower bound
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % workers
    size = (hi - lo) // workers
    return range(lo + worker * size, lo + (worker + 1) * size)


def free_port() -> int:
    """A TCP port nobody has bound, from this xdist worker's slice (see _port_slice)."""
    ports = _port_slice()
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # all interfaces: what a TCPStore / the deepspeed launcher binds
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {ports.start}-{ports.stop - 1} after 200 tries")


def rank_threads() -> int:
    """Threads per rank: OMP_NUM_THREADS of the test run (the kernel legs of .ci/run set 1 and 2), else 1.
    Unset means torch would take every core per rank, oversubscribing the machine."""
    return max(1, int(os.environ.get("OMP_NUM_THREADS") or 1))


# Imported once by the fork server; nothing here may start threads or read per-test state at import.
FORKSERVER_PRELOAD = ["torch", "timm", "deepspeed", "dsclip.engine.build", "dsclip.train.loop"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _rank_main(rank, world_size, port, fn, args, queue, environ):
    # the test's environment now (monkeypatch.setenv included), not the fork server's from its start
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        OMP_NUM_THREADS=str(rank_threads()),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(rank_threads())
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:  # read by torch._inductor.config at import (preloaded)
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        # Plain-pickle the result: a torch.multiprocessing queue would pass tensors as shared-memory
        # file descriptors that the parent fetches from this process, which may already have exited.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be importable (module-level) and its result picklable. Raises with the failing
    rank's traceback if any rank fails.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, queue, environ)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                errors.append(f"timed out after {timeout:.0f} s waiting for rank(s) {missing} (hang?)")
                break
            if status == "error":
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks may now be stuck in a collective; stop them below
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
